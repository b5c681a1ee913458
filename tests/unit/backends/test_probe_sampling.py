"""--diffusion-debug-probe-micro-batches: the parity probe's extra forwards, sampled."""

from __future__ import annotations

import pytest

from dtype_helpers import engine_for, one_rollout, tiny_args
from rollout_helpers import as_a_rank_gets_it
from miles.backends.parity_probe import probe_limit, probed_extra_micro_batches
from miles.backends.rollout_shard import probed_outputs
from miles.flags.batching import rank_schedule
from miles.flags.batch_rules import ConfigError

# two optimizer steps per rollout (TINY), one pair per forward (the engines sample one sample at a
# time, so that is their forward): the second step's micro-batches are the ones the probe must
# re-run before the first step changes the weights
ONE_PAIR = "--rollout-microgroup-size 1 --micro-batch-size 1"


def _forwards_and_metrics(args, plan, batch):
    from miles.backends.actor import TrainRank

    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    calls = []
    velocity = rank.fmodel.velocity
    rank.fmodel.velocity = lambda *a, **kw: calls.append(1) or velocity(*a, **kw)
    metrics = rank.train(batch).metrics
    return len(calls), {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def test_sampling_one_micro_batch_saves_the_other_probe_forwards_and_changes_no_metric(tmp_path):
    args, plan = tiny_args(tmp_path / "every", ONE_PAIR)
    sampled_args, _ = tiny_args(tmp_path / "one", f"{ONE_PAIR} --diffusion-debug-probe-micro-batches 1")
    batch = one_rollout(args, 0, engine_for(args))  # the flag changes nothing the engines do
    later = len(probed_extra_micro_batches(rank_schedule(plan, batch.trained_steps, 0), 0))
    # each run gets only the model outputs its probe compares, as the engines keep them in a run:
    # a probe wanting one they did not keep stops the step
    every_calls, every = _forwards_and_metrics(args, plan, as_a_rank_gets_it(args, plan, batch))
    one_calls, sampled = _forwards_and_metrics(sampled_args, plan, as_a_rank_gets_it(sampled_args, plan, batch))
    # one micro-batch per rollout: the first step's first, on its training forward; no extra forward
    assert later >= 2 and every_calls - one_calls == later
    assert sampled["train/model_output_max_abs_diff"] == 0.0 and sampled["train/log_prob_abs_diff"] == 0.0
    # the probe's forwards are no-grad on the weights before the step: training is the same
    assert sampled["train/loss"] == every["train/loss"] and sampled["train/grad_norm"] == every["train/grad_norm"]
    # the engines kept one pair's model output for the sampled probe, every trained pair's for the other
    first = rank_schedule(plan, batch.trained_steps, 0)[0][0]
    assert probed_outputs(sampled_args, plan, batch.trained_steps) == {p.sample: (p.step,) for p in first}
    assert sum(map(len, probed_outputs(args, plan, batch.trained_steps).values())) == plan.train_pairs


def test_the_limit_counts_the_first_steps_micro_batches_before_any_extra_forward():
    schedule = [[["a"], ["b"]], [["c"], ["d"]], [["e"]]]
    assert probed_extra_micro_batches(schedule, 0) == [["c"], ["d"], ["e"]]
    assert probed_extra_micro_batches(schedule, 2) == []  # the first step's two suffice
    assert probed_extra_micro_batches(schedule, 3) == [["c"]]
    assert probed_extra_micro_batches(schedule, 9) == [["c"], ["d"], ["e"]]


def test_unset_the_cpu_tier_checks_every_micro_batch_and_a_gpu_run_one():
    from argparse import Namespace

    assert probe_limit(Namespace(device="cpu", diffusion_debug_probe_micro_batches=None)) == 0
    assert probe_limit(Namespace(device="cuda", diffusion_debug_probe_micro_batches=None)) == 1
    assert probe_limit(Namespace(device="cuda", diffusion_debug_probe_micro_batches=0)) == 0
    assert probe_limit(Namespace(device="cpu", diffusion_debug_probe_micro_batches=3)) == 3


def test_sampling_without_the_probe_is_refused_naming_the_fix(tmp_path):
    from dtype_helpers import TINY, tiny_assets
    from miles.flags.arguments import parse_and_plan

    checkpoint, prompts = tiny_assets()
    argv = (f"--hf-checkpoint {checkpoint} --prompt-data {prompts} --run-dir {tmp_path} {TINY} "
            "--actor-num-gpus-per-node 1 --num-gpus-per-node 2 --diffusion-debug-probe-micro-batches 1").split()
    argv.remove("--diffusion-debug-mode")
    with pytest.raises(ConfigError, match="--diffusion-debug-probe-micro-batches 1 without --diffusion-debug-mode.*fix"):
        parse_and_plan(argv)
