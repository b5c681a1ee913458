"""Static invariants of a dry run, checked on hand-written plans (no subprocess)."""

import argparse
from pathlib import Path

import pytest

from miles.testing import RecipeCase
from miles.testing.dry import DryCheckFailure, DryRun, check_static, last_flag_values, scrubbed_env

TINY_ARGV = ("--hf-checkpoint /m/miles-sd3-tiny-seed0 --diffusion-model-family sd3 --prompt-data /d/p.jsonl "
             "--num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 8 --diffusion-num-steps 8 "
             "--diffusion-num-sde-steps 2 --num-steps-per-rollout 1 --rm-type color_match --lr 3e-4 "
             "--device cpu --num-gpus-per-node 1 --colocate").split()


def dry(argv, **plan):
    base = {"argv": list(argv), "locked_flags": {}, "num_nodes": 1, "num_gpus_per_node": 0}
    base.update(plan)
    return DryRun(RecipeCase.dry("scripts/run_x.py"), ["python3"], Path("/tmp/x"), 0, "", 0.1, plan=base)


def test_valid_argv_passes_and_returns_the_batch_plan():
    bp = check_static(dry(TINY_ARGV))
    assert bp.train_pairs == 64 and bp.dp_size == 1


def test_non_dividing_pair_shards_fail_with_the_validators_message():
    argv = [a if a != "1" or TINY_ARGV[i - 1] != "--num-steps-per-rollout" else "3" for i, a in enumerate(TINY_ARGV)]
    with pytest.raises(DryCheckFailure, match="num_pairs_shard=64 not divisible by num_steps_per_rollout=3"):
        check_static(dry(argv))


def test_unknown_flag_is_reported_with_the_argv():
    with pytest.raises(DryCheckFailure, match="parser rejects"):
        check_static(dry(TINY_ARGV + ["--no-such-flag"]))


def test_locked_flag_changed_by_a_later_value_fails():
    d = dry(TINY_ARGV + ["--lr", "1e-2"], locked_flags={"--lr": "3e-4"})
    with pytest.raises(DryCheckFailure, match="locked flag --lr changed"):
        check_static(d)
    check_static(dry(TINY_ARGV, locked_flags={"--lr": "3e-4", "--colocate": None}))


def test_gpu_layout_larger_than_the_launchers_cluster_fails():
    gpu_argv = [a if a != "cpu" else "cuda" for a in TINY_ARGV]
    gpu_argv = gpu_argv[:-3] + ["--num-gpus-per-node", "4", "--actor-num-gpus-per-node", "4", "--colocate"]
    check_static(dry(gpu_argv, num_gpus_per_node=4))
    with pytest.raises(DryCheckFailure, match="the launcher gives each node 2"):
        check_static(dry(gpu_argv, num_gpus_per_node=2))


def test_batch_identity_is_asserted_on_the_plan_the_validator_returns():
    fake_plan = argparse.Namespace(samples_per_rollout=30, rollout_batch_size=4, n_samples_per_prompt=8,
                                   global_batch_size=None, num_steps_per_rollout=1, train_pairs=60, dp_size=1)
    with pytest.raises(DryCheckFailure, match="batch identity"):
        check_static(dry(TINY_ARGV), validate=lambda argv: fake_plan)


def test_last_flag_value_wins():
    assert last_flag_values(["--a", "1", "--b", "--a", "2", "3"], "--a") == ["2", "3"]
    assert last_flag_values(["--a=5"], "--a") == ["5"]
    assert last_flag_values(["--b"], "--a") is None


def test_dry_runs_ignore_the_callers_script_options_and_gpus():
    env = scrubbed_env({"MILES_SCRIPT_NUM_NODES": "4", "CUDA_VISIBLE_DEVICES": "0", "WANDB_API_KEY": "k", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}
