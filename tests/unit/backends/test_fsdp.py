"""--train-backend fsdp (FSDP2 over gloo on the CPU) and --offload-train / --offload-rollout."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtype_helpers import engine_for, one_rollout, tiny_args
from fsdp_helpers import fsdp_args
from miles.backends.collectives import free_port

# one optimizer step per rollout: with more, each rank's window holds its own samples, so 1 and 2
# ranks would step on different global batches (the plan deals pairs to ranks before windows)
OFFLOAD = "--colocate --offload-train --offload-rollout --num-steps-per-rollout 1"
# 2 sharded ranks vs 1 unsharded rank, fp32, one AdamW step (clip 1.0). Not bit-exact: the
# sharded ranks reduce-scatter each micro-batch's gradient, (a_1 + b_1) / 2 + (a_2 + b_2) / 2, the
# single rank sums a_1 + a_2 + b_1 + b_2 in backward order; that rounding (measured: grad norms
# equal to 3e-8 relative) passes through Adam's m / sqrt(v), which on a first step is about
# lr x sign(g), to the weights: measured max |difference| 8.6e-7 at lr 1e-3.
RTOL, ATOL = 1e-5, 1e-6


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_two_sharded_ranks_match_one_rank_keep_parity_exact_offload_and_resume_bit_exact(tmp_path):
    from miles.backends.actor import TrainRank

    args1, plan1 = tiny_args(tmp_path / "single", OFFLOAD)
    batch0 = one_rollout(args1, 0, engine_for(args1))
    torch.save(batch0, tmp_path / "batch0.pt")
    mp.start_processes(_run_rank, args=(free_port(), str(tmp_path), OFFLOAD, str(tmp_path / "batch0.pt")),
                       nprocs=2, join=True, start_method="spawn")
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    single = TrainRank(args1, plan1, 0, 1)
    single.setup()
    single_metrics = single.train(batch0).metrics
    expected = single.trained_state()

    assert result["param_types"] == ["DTensor"]
    for key in ("metrics0", "metrics1", "metrics1_resumed"):  # engines sampled on the weights trained
        assert result[key]["train/model_output_max_abs_diff"] == 0.0, (key, result[key])
        assert result[key]["train/log_prob_abs_diff"] == 0.0, key
    diff = max_abs_diff(result["state0"], expected)
    print(f"2 sharded ranks vs 1 rank: max abs weight difference {diff:.3g}")
    assert any(not torch.equal(result["state0"][n], result["state1"][n]) for n in expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result["state0"][name], tensor, rtol=RTOL, atol=ATOL, msg=name)

    offload = result["offload"]
    assert offload["tensors"] > 0 and offload["offloaded_bytes"] == 0 and offload["reloaded_bytes"] > 0
    assert offload["round_trip_equal"]
    assert result["engine_offloaded_after_generate"]

    assert result["resumed_step"] == 1
    assert bit_equal(result["state1_resumed"], result["state1"])
    assert bit_equal(result["optim1_resumed"], result["optim1"])
    assert result["metrics1_resumed"]["train/loss"] == result["metrics1"]["train/loss"]
    assert result["metrics0"]["train/grad_norm"] == pytest.approx(single_metrics["train/grad_norm"], rel=1e-6)

    # the 2-rank checkpoint on 1 rank: DCP reshards it, every saved weight back bit for bit
    args_one, plan_one = fsdp_args(tmp_path / "one", OFFLOAD, 1)
    with one_rank_group():
        one = TrainRank(args_one, plan_one, 0, 1)
        one.setup()
        one.load(str(tmp_path / "ckpt"))
        assert one.optimizer_step == 1
        assert bit_equal(one.trained_state(), result["state0"])


@contextmanager
def one_rank_group():
    """A 1-rank fsdp TrainRank makes this process a group of one; leave no group behind."""
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_rank(rank_id, port, run_dir, flags, batch_path):
    from fsdp_helpers import two_rank_run

    two_rank_run(rank_id, port, run_dir, flags, batch_path)
