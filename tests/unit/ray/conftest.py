"""A private 2-CPU Ray cluster and tiny assets, shared by the trainer tests of this folder."""

from __future__ import annotations


import pytest

TINY_FLAGS = (
    "--rollout-batch-size 2 --n-samples-per-prompt 4 --diffusion-height 64 --diffusion-width 64 "
    "--diffusion-num-steps 4 --diffusion-num-sde-steps 2 --rm-type color_match --device cpu "
    "--lr 1e-3 --diffusion-clip-range 1e-2 --diffusion-debug-mode"
)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory, tiny_checkpoint):
    from miles.proxy_assets.prompts import ensure_prompt_file

    root = tmp_path_factory.mktemp("assets")
    checkpoint = tiny_checkpoint("sd3")
    prompts = ensure_prompt_file("tiny", root / "prompts.jsonl", num_prompts=16)
    return checkpoint, prompts


@pytest.fixture
def ray_cluster(local_ray):
    """The worker's local cluster (tests/unit/conftest.py), held for the test; its GCS address."""
    return local_ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")  # a pure builder: module fixtures build their runs' argv with it too
def tiny_argv(tiny_assets):
    """argv of a tiny CPU run: tiny_argv(run_dir, "--more flags")."""
    checkpoint, prompts = tiny_assets

    def build(run_dir, extra: str = "") -> list[str]:
        return f"--hf-checkpoint {checkpoint} --prompt-data {prompts} --run-dir {run_dir} {TINY_FLAGS} {extra}".split()

    build.checkpoint = checkpoint
    return build
