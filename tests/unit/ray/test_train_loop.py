"""The training loop end to end on a private Ray cluster: parity probe, determinism, DP ranks."""

from __future__ import annotations

import pytest
import torch

import train_diffusion
from miles.backends.metrics import read_metrics

RANKS = {1: "--actor-num-gpus-per-node 1 --num-gpus-per-node 1 --colocate",
         2: "--actor-num-gpus-per-node 2 --num-gpus-per-node 2 --colocate"}


def run(tiny_argv, run_dir, extra) -> list[dict]:
    assert train_diffusion.main(tiny_argv(run_dir, extra)) == 0
    return read_metrics(run_dir)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_parity_probe_is_exactly_zero_when_weights_are_synced(ray_cluster, tiny_argv, tmp_path, ranks, lora):
    extra = f"{RANKS[ranks]} --num-rollout 3" + (" --use-lora --lora-rank 4" if lora else "")
    rows = run(tiny_argv, tmp_path, extra)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for key in ("train/model_output_mean_abs_diff", "train/model_output_max_abs_diff", "train/log_prob_abs_diff"):
        assert [r[key] for r in rows] == [0.0, 0.0, 0.0], key
    # the weights did move: otherwise a zero diff would prove nothing
    assert all(r["train/grad_norm"] > 0 for r in rows)


def test_a_skipped_weight_update_makes_the_parity_probe_fail(ray_cluster, tiny_argv, tmp_path):
    rows = run(tiny_argv, tmp_path, f"{RANKS[1]} --num-rollout 3 --debug-skip-weight-update-at 0")
    diffs = [r["train/model_output_max_abs_diff"] for r in rows]
    # rollout 1 was sampled by stale weights; rollout 2 again by synced ones
    assert diffs[0] == 0.0 and diffs[1] > 0.0 and diffs[2] == 0.0
    assert rows[1]["train/log_prob_abs_diff"] > 0.0


def test_two_deterministic_runs_write_identical_metrics(ray_cluster, tiny_argv, tmp_path):
    extra = f"{RANKS[2]} --num-rollout 3 --deterministic-mode"
    run(tiny_argv, tmp_path / "a", extra)
    run(tiny_argv, tmp_path / "b", extra)
    first = (tmp_path / "a" / "metrics.jsonl").read_bytes()
    assert first == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    assert b"perf/" not in first and b"train/loss" in first
    for name in ("run.json", "perf.jsonl", "curves.png", "last_rollout.png"):
        assert (tmp_path / "a" / name).exists(), name


def test_skipped_optimizer_steps_keep_parity_and_eval_runs_on_its_interval(ray_cluster, tiny_argv, tmp_path):
    rows = run(tiny_argv, tmp_path, f"{RANKS[1]} --num-rollout 2 --debug-skip-optimizer-step "
                                    "--eval-interval 2 --eval-num-prompts 2")
    assert [r["train/model_output_max_abs_diff"] for r in rows] == [0.0, 0.0]
    assert rows[0]["train/grad_norm"] > 0
    assert "eval/reward/raw_mean" not in rows[0] and 0.0 <= rows[1]["eval/reward/raw_mean"] <= 1.0


def test_rollout_only_generates_and_scores_without_training(ray_cluster, tiny_argv, tmp_path):
    rows = run(tiny_argv, tmp_path, "--num-rollout 2 --debug-rollout-only --start-rollout-id 3 --num-rollout 5")
    assert [r["rollout_id"] for r in rows] == [3, 4]
    assert all("rollout/reward/raw_mean" in r and "train/loss" not in r for r in rows)
