"""Tiny sd3 runs driven in process (no Ray) by the dtype, collectives and checkpointing tests.

MILES_TEST_DEVICE=cuda runs them on a GPU instead (ci/gpu_check.sh's first stage): the same
train step, parity probe and weight push, with the GPU's kernels.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# miles.testing.plugin.MODEL_DIR_ENV, spelled out: the ranks these tests spawn import this module,
# and the plugin would bring pytest into each of them
MODEL_DIR_ENV = "MILES_TEST_MODEL_DIR"

DEVICE = os.environ.get("MILES_TEST_DEVICE", "cpu")
TINY = ("--rollout-batch-size 2 --n-samples-per-prompt 2 --diffusion-height 64 --diffusion-width 64 "
        f"--diffusion-num-steps 4 --diffusion-num-sde-steps 2 --rm-type brightness --device {DEVICE} --lr 1e-3 "
        "--diffusion-clip-range 1e-2 --diffusion-debug-mode --num-rollout 2 --num-steps-per-rollout 2")


def assets_dir() -> Path:
    """The harness's checkpoint cache, which tests/unit/backends/conftest.py names in the environment
    (so that the ranks these tests spawn find it too): the checkpoints the e2e runs and the other
    unit tests build once are not built again here (sd3's alone is 6-11 CPU-s)."""
    return Path(os.environ[MODEL_DIR_ENV])


def tiny_assets(family: str = "sd3"):
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.proxy_assets.prompts import ensure_prompt_file

    checkpoint = ensure_checkpoint(family, "tiny", 0, assets_dir())
    prompts = ensure_prompt_file("tiny", assets_dir() / "tiny_prompts_16.jsonl", num_prompts=16)
    return checkpoint, prompts


def tiny_args(run_dir, extra: str = ""):
    from miles.flags.arguments import parse_and_plan

    checkpoint, prompts = tiny_assets()
    defaults = "" if "--actor-num-gpus-per-node" in extra else "--actor-num-gpus-per-node 1 --num-gpus-per-node 2"
    argv = f"--hf-checkpoint {checkpoint} --prompt-data {prompts} --run-dir {run_dir} {TINY} {defaults} {extra}"
    return parse_and_plan(argv.split())


def engine_for(args):
    from miles.models.runtime import CPU_THREADS_PER_ACTOR
    from miles.rollout.engine import RolloutEngine

    return RolloutEngine.from_args(args, num_threads=CPU_THREADS_PER_ACTOR)


def one_rollout(args, rollout_id: int = 0, engine=None, dataset=None, debug: bool = True):
    """A scored rollout of the tiny run (trained steps 0 and 1), as the driver would hand it over;
    `debug`: the engine records what the parity probe compares."""
    from miles.backends.loss import compute_advantages
    from miles.backends.types import RolloutBatch
    from miles.ray.rollout_manager import sample_seed
    from miles.rollout.data import PromptDataset
    from miles.rollout.rm_hub.pool import LocalRewardScorer
    from miles.rollout.rm_hub.types import RewardSample
    from miles.rollout.types import SampleRequest

    engine = engine or engine_for(args)
    dataset = dataset or PromptDataset.from_args(args)
    items = dataset.next_batch(args.rollout_batch_size)
    requests = [SampleRequest(it.prompt, g, j, sample_seed(args.rollout_seed, rollout_id, g, j), dict(it.metadata))
                for g, it in enumerate(items) for j in range(args.n_samples_per_prompt)]
    trajectories = engine.generate(requests, [0, 1], debug)
    rewards = LocalRewardScorer(args).score([RewardSample(t.prompt, t.image, t.metadata) for t in trajectories])
    advantages = compute_advantages(torch.tensor(rewards), args.n_samples_per_prompt)
    return RolloutBatch(rollout_id, trajectories, rewards, advantages.tolist(), [0, 1])
