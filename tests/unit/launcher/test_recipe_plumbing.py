"""What recipes share through U: scale rows, asset naming (a dry run makes nothing) and flag blocks."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest

import miles.launcher.recipe_api as U
from miles.proxy_assets import FIT_VERSION


@dataclass(frozen=True, kw_only=True)
class _Scale(U.RolloutScale):
    train_ranks: int


SCALES = {
    "full": _Scale(U.FULL_SCALE, train_ranks=4, num_steps=10, rollout_batch_size=8, n_samples_per_prompt=4,
                   rm_num_workers=4, reward_gpus=1, num_prompts=100, num_rollout=300, eval_interval=10),
    "1gpu-proxy": _Scale(U.GPU_PROXY, train_ranks=1, num_steps=10, rollout_batch_size=2, n_samples_per_prompt=4,
                         rm_num_workers=1, reward_gpus=0.25, colocate_reward=True, num_prompts=64, num_rollout=2),
    "cpu-proxy": _Scale(U.CPU_PROXY, train_ranks=2, num_steps=6, rollout_batch_size=2, n_samples_per_prompt=4,
                        rm_num_workers=1, num_prompts=16, num_rollout=2),
}


@dataclass
class _Dirs:
    model_dir: str
    data_dir: str


def test_num_rollout_help_lists_each_scales_default_grouped():
    help_text = U.num_rollout_option(SCALES).metadata["help"]
    assert help_text == "Rollouts to train; unset: 300 (full), 2 (1gpu-proxy, cpu-proxy)."


def test_a_dry_run_names_the_assets_and_makes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    dirs = _Dirs(str(tmp_path / "models"), str(tmp_path / "data"))
    released = U.ensure_assets("sd3", SCALES["full"], dirs, released="SD3", pickscore=True)
    ours = U.ensure_assets("sd3", SCALES["cpu-proxy"], dirs, released="SD3", prompts="ocr")
    # full scale: an unknown released name is read from --model-dir; PickScore and the prompts are fetched
    assert released == U.Assets(f"{dirs.model_dir}/SD3", f"{dirs.data_dir}/pickscore_train_ac4c86e8cae0.jsonl",
                                f"{dirs.data_dir}/pickscore_test_ac4c86e8cae0.jsonl",
                                f"{tmp_path}/hf/hub/models--yuvalkirstain--PickScore_v1/snapshots/main")
    assert ours == U.Assets(f"{dirs.model_dir}/miles-sd3-tiny-seed0", f"{dirs.data_dir}/ocr_prompts_16.jsonl",
                            f"{dirs.data_dir}/ocr_eval_prompts_64.jsonl", "")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_outside_a_dry_run_the_makers_are_called_once_each(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "1")
    made = []
    fakes = {
        "miles.proxy_assets.checkpoint": {"ensure_checkpoint": lambda f, s, seed, root: made.append(("ckpt", f, s))
                                           or root / f"made-{f}-{s}"},
        "miles.proxy_assets.prompts": {"ensure_prompt_file": lambda kind, path, num_prompts, seed: made.append(
            ("prompts", kind, num_prompts, seed))},
        "miles.proxy_assets.pickscore": {"ensure_tiny_pickscore": lambda root, seed: made.append(("pickscore",))
                                           or root / "made-pickscore"},
    }
    for name, functions in fakes.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**functions))
    assets = U.ensure_assets("wan2_2", SCALES["1gpu-proxy"], _Dirs(str(tmp_path), str(tmp_path)), released="X",
                             pickscore=True)
    assert made == [("prompts", "general", 64, 0), ("prompts", "general", 64, 1), ("ckpt", "wan2_2", "proxy"),
                    ("pickscore",)]
    assert assets.checkpoint.endswith("made-wan2_2-proxy") and assets.pickscore.endswith("made-pickscore")


def _cached_checkpoint(root, family, size, vae_class, marker):
    path = root / f"miles-{family}-{size}-seed0"
    path.mkdir(parents=True)
    index = {"vae": ["diffusers", vae_class]} | ({"_miles_vae_fit": marker} if marker is not None else {})
    (path / "model_index.json").write_text(json.dumps(index))
    (path / "vae").mkdir()  # complete: the component model_index.json names, with its config and weights
    (path / "vae" / "config.json").write_text("{}")
    (path / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return path


def test_a_current_cached_checkpoint_and_pickscore_are_used_without_calling_the_makers(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "1")
    for name in ("miles.proxy_assets.checkpoint", "miles.proxy_assets.pickscore"):
        monkeypatch.setitem(sys.modules, name, None)  # importing a maker would raise
    fitted = _cached_checkpoint(tmp_path, "sd3", "tiny", "AutoencoderKL", FIT_VERSION)
    unfitted = _cached_checkpoint(tmp_path, "wan2_2", "tiny", "AutoencoderKLWan", None)
    (tmp_path / "tiny-pickscore-seed0").mkdir()
    (tmp_path / "tiny-pickscore-seed0" / "config.json").write_text("{}")
    assert U.ensure_recipe_checkpoint("sd3", "tiny", tmp_path) == str(fitted)
    assert U.ensure_recipe_checkpoint("wan2_2", "tiny", tmp_path) == str(unfitted)
    assert U.ensure_pickscore("tiny", tmp_path) == str(tmp_path / "tiny-pickscore-seed0")


@pytest.mark.parametrize("index", [None, "not json", {"_miles_vae_fit": FIT_VERSION},
                                   {"vae": ["diffusers", "AutoencoderKL"]},
                                   {"vae": ["diffusers", "AutoencoderKL"], "_miles_vae_fit": FIT_VERSION - 1}])
def test_an_incomplete_or_stale_cached_checkpoint_goes_to_the_maker(tmp_path, monkeypatch, index):
    monkeypatch.setenv("MILES_SCRIPT_ENABLE_RAY_SUBMIT", "1")
    made = []
    monkeypatch.setitem(sys.modules, "miles.proxy_assets.checkpoint", types.SimpleNamespace(
        ensure_checkpoint=lambda f, s, seed, root: made.append(f) or root / "rebuilt"))
    path = tmp_path / "miles-sd3-tiny-seed0"
    path.mkdir()
    if index is not None:
        (path / "model_index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    assert U.ensure_recipe_checkpoint("sd3", "tiny", tmp_path) == str(tmp_path / "rebuilt")
    assert made == ["sd3"]


def test_pickscore_workers_share_the_reward_gpus_or_a_share_of_the_train_gpu():
    assert U.pickscore_args("/p", SCALES["full"]).endswith("--rm-num-workers 4 --rm-num-gpus-per-worker 0.25 ")
    colocated = U.pickscore_args("/p", SCALES["1gpu-proxy"])
    assert colocated.endswith("--rm-num-gpus-per-worker 0.25 --colocate-reward ")
    assert SCALES["1gpu-proxy"].separate_reward_gpus == 0 and SCALES["full"].separate_reward_gpus == 1
    assert U.pickscore_args("/p", SCALES["cpu-proxy"]).endswith("--rm-num-gpus-per-worker 0 ")


def test_colocated_misc_args_keep_the_gpu_budget_off_cpu_and_determinism_last():
    assert U.colocated_misc_args(SCALES["full"], 80, 4, 5) == (
        "--device cuda --gpu-memory-gb 80 --actor-num-nodes 1 --actor-num-gpus-per-node 4 --num-gpus-per-node 5 "
        "--colocate --diffusion-debug-mode "
    )
    assert U.colocated_misc_args(SCALES["cpu-proxy"], 80, 2, 2, train_nodes=1, job_nodes=1) == (
        "--device cpu --actor-num-nodes 1 --actor-num-gpus-per-node 2 --num-nodes 1 --num-gpus-per-node 2 "
        "--colocate --diffusion-debug-mode --deterministic-mode "
    )
    assert SCALES["cpu-proxy"].ray_gpus(2) == 0 and SCALES["full"].ray_gpus(5) == 5
