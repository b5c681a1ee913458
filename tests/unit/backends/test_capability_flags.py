"""What miles-diffusion's capability flags do to a real TrainRank step (in process, tiny sd3):
--fsdp-reduce-dtype and --diffusion-recompute-old-log-prob."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dtype_helpers import engine_for, one_rollout, tiny_args
from fsdp_helpers import fsdp_args
from test_fsdp import one_rank_group


def _first_micro_batch_gradients(run_dir, flags: str, batch=None) -> tuple[dict[str, torch.Tensor], object]:
    """This rank's shard of each gradient after the first micro-batch's backward (no optimizer step)."""
    from miles.backends.actor import TrainRank
    from miles.flags.batching import rank_schedule

    args, plan = fsdp_args(run_dir, f"--colocate {flags}", 1)
    batch = batch if batch is not None else one_rollout(args, 0, engine_for(args))
    with one_rank_group():
        rank = TrainRank(args, plan, 0, 1)
        rank.setup()
        micro = rank_schedule(rank.plan, batch.trained_steps, 0)[0][0]
        loss, _ = rank._micro_batch_loss(batch, micro, None, None)
        loss.backward()
        grads = {n: p.grad.to_local().clone() for n, p in rank.params.items() if p.grad is not None}
    return grads, batch


def test_fsdp_reduce_dtype_bf16_reduces_gradients_in_bf16_and_keeps_them_in_the_param_dtype(tmp_path):
    """A gradient reduced in bf16 and kept in float32 holds only bf16 values; one reduced in
    float32 (unset: the param dtype) does not (a tiny model's gradients are not all bf16 numbers)."""
    bf16, batch = _first_micro_batch_gradients(tmp_path / "bf16", "--fsdp-reduce-dtype bf16")
    fp32, _ = _first_micro_batch_gradients(tmp_path / "fp32", "", batch)
    assert bf16 and sorted(bf16) == sorted(fp32)
    assert {g.dtype for g in bf16.values()} == {torch.float32}
    assert all(torch.equal(g, g.bfloat16().float()) for g in bf16.values())
    assert not all(torch.equal(g, g.bfloat16().float()) for g in fp32.values())
    # the same gradient, rounded: within bf16's relative step of 2^-8 of the float32 one (a sum of a
    # few terms rounded once per operation, so a few steps at most)
    for name, g in bf16.items():
        assert torch.allclose(g, fp32[name], rtol=2 ** -5, atol=1e-6 * float(fp32[name].abs().max())), name


def test_recomputed_old_log_probs_replace_the_engines_in_the_ppo_ratio(tmp_path):
    """The engines' stored log-probs are shifted by 0.5: without the flag the ratio moves off 1 (pairs
    clipped); with it the one optimizer step sees ratio 1 exactly (the train forward recomputes what it
    then computes again, same batch, same weights), so the loss is the mean of -advantage over the
    kept pairs (up to float summation order, 1e-6 relative)."""
    from miles.backends.actor import TrainRank

    def train(name: str, flags: str, batch) -> dict[str, float]:
        args, plan = tiny_args(tmp_path / name, flags)
        rank = TrainRank(args, plan, 0, 1)
        rank.setup()
        return rank.train(batch).metrics

    args, _ = tiny_args(tmp_path / "sample", "--num-steps-per-rollout 1")
    batch = one_rollout(args, 0, engine_for(args))
    shifted = dataclasses.replace(batch, trajectories=[dataclasses.replace(t, log_probs=t.log_probs + 0.5)
                                                       for t in batch.trajectories])
    stale = train("stale", "--num-steps-per-rollout 1", shifted)
    recomputed = train("recomputed", "--num-steps-per-rollout 1 --diffusion-recompute-old-log-prob", shifted)
    kept = [a for a in batch.advantages if a != 0.0]  # flow_grpo drops zero advantages
    assert stale["train/ppo_clipfrac"] > 0.0 and recomputed["train/ppo_clipfrac"] == 0.0
    assert recomputed["train/loss"] == pytest.approx(-sum(kept) / len(kept), rel=1e-6, abs=1e-7)
    assert stale["train/loss"] != pytest.approx(recomputed["train/loss"], rel=1e-6, abs=1e-7)
    assert recomputed["train/model_output_max_abs_diff"] == 0.0  # the probe still compares with the engines
