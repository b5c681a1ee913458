"""--train-backend fsdp (FSDP2 over gloo on the CPU) and --offload-train / --offload-rollout."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtype_helpers import engine_for, one_rollout, tiny_args
from fsdp_helpers import fsdp_args
from process_start import start_method
from miles.utils.ports import free_ports
from tests.tools.adam_bound import check_first_adamw_step

# one optimizer step per rollout: with more, each rank's window holds its own samples, so 1 and 2
# ranks would step on different global batches (the plan deals pairs to ranks before windows)
OFFLOAD = "--colocate --offload-train --offload-rollout --num-steps-per-rollout 1"
# 2 sharded ranks vs 1 unsharded rank, fp32, one AdamW step. Not bit-exact: the sharded ranks
# reduce-scatter each micro-batch's gradient, (a_1 + b_1) / 2 + (a_2 + b_2) / 2, the single rank
# sums a_1 + a_2 + b_1 + b_2 in backward order (and FSDP's kernels round inside backward on their
# own: 1-rank fsdp vs 1-rank dp differ too). What one AdamW step makes of that is derived in
# tests/tools/adam_bound.py: up to 2 lr for a weight whose gradient is within rounding of 0, the same
# step overall. Parity, the offload round trip and the resume are exact and compared exactly.


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_two_sharded_ranks_and_two_hsdp_replicas_match_one_rank_keep_parity_exact_offload_and_resume_bit_exact(tmp_path, worker_ray):
    from miles.backends.actor import TrainRank

    args1, plan1 = tiny_args(tmp_path / "single", OFFLOAD)
    batch0 = one_rollout(args1, 0, engine_for(args1))
    torch.save(batch0, tmp_path / "batch0.pt")
    mp.start_processes(_run_rank, args=(free_ports(1)[0], str(tmp_path), OFFLOAD, str(tmp_path / "batch0.pt")),
                       nprocs=2, join=True, start_method=start_method(ray_ran_here=worker_ray.starts > 0))
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    single = TrainRank(args1, plan1, 0, 1)
    single.setup()
    start = single.trained_state()
    single_metrics = single.train(batch0).metrics
    expected = single.trained_state()
    assert single.optimizer_step == 1  # the bound below is that of one AdamW step

    assert result["param_types"] == ["DTensor"]
    for key in ("metrics0", "metrics1", "metrics1_resumed"):  # engines sampled on the weights trained
        assert result[key]["train/model_output_max_abs_diff"] == 0.0, (key, result[key])
        assert result[key]["train/log_prob_abs_diff"] == 0.0, key
    worst, ratio = check_first_adamw_step(result["state0"], expected, start, args1.lr)
    print(f"2 sharded ranks vs 1 rank: max abs weight difference {worst:.3g} lr, ||difference|| {ratio:.3g} ||step||")
    assert any(not torch.equal(result["state0"][n], result["state1"][n]) for n in expected)

    offload = result["offload"]
    assert offload["tensors"] > 0 and offload["offloaded_bytes"] == 0 and offload["reloaded_bytes"] > 0
    assert offload["round_trip_equal"]
    assert result["engine_offloaded_after_generate"]

    assert result["resumed_step"] == 1
    assert bit_equal(result["state1_resumed"], result["state1"])
    assert bit_equal(result["optim1_resumed"], result["optim1"])
    assert result["metrics1_resumed"]["train/loss"] == result["metrics1"]["train/loss"]
    # the same gradient up to rounding: | |g_a| - |g_b| | <= |g_a - g_b|, rounding of terms of size up
    # to 1e3 |g| (cancellation in backward) at fp32's 6e-8 per operation times a few hundred
    # operations per element stays below 1e-3 |g|; another gradient (another shard) differs by O(1)
    assert result["metrics0"]["train/grad_norm"] == pytest.approx(single_metrics["train/grad_norm"], rel=1e-3)

    # --dp-replicate-size 2: a 2 x 1 mesh, each replica one shard of the whole weight; both replicas
    # average every rank's gradients as the single rank does over the whole batch (the same bound),
    # stay equal bit for bit, and count each gradient element once in the norm (the two replicas
    # counted twice would give sqrt(2) times the single rank's)
    hsdp = result["hsdp"]
    assert hsdp["placements"] == ["(Replicate(), Shard(dim=0))"] and hsdp["local_is_whole"]
    assert bit_equal(*hsdp["local_states"])
    assert hsdp["metrics"]["train/model_output_max_abs_diff"] == 0.0
    check_first_adamw_step(hsdp["state"], expected, start, args1.lr)
    assert hsdp["metrics"]["train/grad_norm"] == pytest.approx(single_metrics["train/grad_norm"], rel=1e-3)

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


BF16_LORA = "--colocate --compute-dtype bfloat16 --rollout-dtype bfloat16 --param-dtype float32 --use-lora --lora-rank 4"


def test_sharded_lora_with_bf16_compute_keeps_parity_exact_without_a_compute_copy(tmp_path):
    """fp32 master shards all-gathered in bf16: the weights a forward reads are the master rounded
    to bf16, as the engine holds them after the push, so parity stays exactly 0.0."""
    from miles.backends.actor import TrainRank
    from miles.rollout.data import PromptDataset

    args, plan = fsdp_args(tmp_path, BF16_LORA, 1)
    engine, dataset = engine_for(args), PromptDataset.from_args(args)
    with one_rank_group():
        rank = TrainRank(args, plan, 0, 1)
        rank.setup()
        engine.apply_lora(rank.lora.rank, rank.lora.alpha, list(rank.lora.target_modules), rank.components)
        assert rank.fmodel is rank.model and rank.fparams is rank.params  # no second copy of the model
        assert {(type(p).__name__, p.dtype) for p in rank.params.values()} == {("DTensor", torch.float32)}
        assert all(".lora_" in n for n in rank.params)
        start = rank.trained_state()
        for rollout_id in range(2):  # the second rollout is sampled on the weights the trainer pushed
            metrics = rank.train(one_rollout(args, rollout_id, engine, dataset)).metrics
            assert metrics["train/model_output_max_abs_diff"] == 0.0, (rollout_id, metrics)
            assert metrics["train/log_prob_abs_diff"] == 0.0
            for update in rank.weight_updates():
                assert update.lora_only and all(".lora_" in n for n in update.state_dict)
                assert {t.dtype for t in update.state_dict.values()} == {torch.bfloat16}
                engine.load_weights(update.component, update.state_dict)
        end = rank.trained_state()
    assert any(not torch.equal(start[n], end[n]) for n in start)


@pytest.mark.parametrize("flags, message", [
    ("--offload-train", "--offload-train without --colocate: .* fix: add --colocate or drop --offload-train"),
    ("--offload-rollout", "--offload-rollout without --colocate"),
    ("--colocate --offload-train --loss-type sft_loss --train-only --n-samples-per-prompt 1",
     "--offload-train: this run has no rollout engines .* fix: drop --offload-train"),
])
def test_offload_without_a_shared_gpu_is_refused_naming_the_fix(flags, message):
    from miles.flags.arguments import ConfigError, parse_args

    argv = "--hf-checkpoint /ckpt/sd3 --num-rollout 1 --rm-type brightness --prompt-data p.jsonl"
    with pytest.raises(ConfigError, match=message):
        parse_args(f"{argv} {flags}".split())
    parse_args(f"{argv} --colocate --offload-train --offload-rollout --train-backend fsdp".split())


@pytest.mark.parametrize("saved, running", [("dp", "fsdp"), ("fsdp", "dp")])
def test_a_checkpoint_of_the_other_train_backend_is_refused_naming_the_flag(tmp_path, saved, running):
    import json

    from miles.backends.fsdp import CheckpointBackendError, check_backend

    (tmp_path / "rank0.json").write_text(json.dumps({"backend": saved, "world_size": 2}))
    with pytest.raises(CheckpointBackendError, match=f"saved by --train-backend {saved} .* this run uses "
                                                     f"--train-backend {running}.* fix: resume with --train-backend "
                                                     f"{saved}"):
        check_backend(tmp_path, running)
    assert check_backend(tmp_path, saved)["world_size"] == 2


def _bf16_lora_run(run_dir) -> dict:
    """Two rollouts of the 1-rank sharded bf16 LoRA run: the first micro-batch's forward before
    training, each rollout's metrics, the adapters after each step and the base weights' bytes."""
    from miles.backends.actor import TrainRank
    from miles.backends.lora import is_lora_param
    from miles.rollout.data import PromptDataset
    from miles.flags.batching import rank_schedule

    args, plan = fsdp_args(run_dir, BF16_LORA, 1)
    engine, dataset = engine_for(args), PromptDataset.from_args(args)
    out: dict = {"metrics": [], "states": []}
    with one_rank_group():
        rank = TrainRank(args, plan, 0, 1)
        rank.setup()
        engine.apply_lora(rank.lora.rank, rank.lora.alpha, list(rank.lora.target_modules), rank.components)
        base = [p for n, p in rank.model.transformers["transformer"].named_parameters() if not is_lora_param(n)]
        out["base_dtypes"] = {p.dtype for p in base}
        out["base_bytes"] = sum(p.to_local().numel() * p.element_size() for p in base)
        for rollout_id in range(2):
            batch = one_rollout(args, rollout_id, engine, dataset)
            if rollout_id == 0:
                micro = rank_schedule(rank.plan, batch.trained_steps, 0)[0][0]
                with torch.no_grad():
                    out["forward"] = rank._forward(batch, micro, None)[0].v.float().cpu()
            out["metrics"].append(rank.train(batch).metrics)
            out["states"].append(rank.trained_state())
            for update in rank.weight_updates():
                engine.load_weights(update.component, update.state_dict)
    return out


def test_a_lora_base_built_in_the_compute_dtype_gives_the_float32_bases_forwards_and_steps(tmp_path, monkeypatch):
    """Under LoRA the frozen base is built in bf16 (the compute dtype), not the float32 master:
    FSDP all-gathered the float32 base cast to bf16, the bf16 base holds the same values (read from
    the file with the same round-to-nearest cast), so forwards, losses and AdamW steps of the adapters
    must be bit for bit those of the float32 base, at half the base's bytes."""
    import miles.backends.sharded_load as sharded_load

    new = _bf16_lora_run(tmp_path / "bf16_base")
    monkeypatch.setattr(sharded_load, "frozen_base_to", lambda module, dtype: 0)  # the float32 base, as before
    old = _bf16_lora_run(tmp_path / "fp32_base")

    assert new["base_dtypes"] == {torch.bfloat16} and old["base_dtypes"] == {torch.float32}
    assert new["base_bytes"] * 2 == old["base_bytes"]
    assert new["forward"].dtype == torch.float32 and new["forward"].abs().sum() > 0
    assert torch.equal(new["forward"], old["forward"])
    for step, (a, b) in enumerate(zip(new["metrics"], old["metrics"], strict=True)):
        assert a["train/model_output_max_abs_diff"] == 0.0 == b["train/model_output_max_abs_diff"], step
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"], step
    for a, b in zip(new["states"], old["states"], strict=True):
        assert bit_equal(a, b)
    assert not bit_equal(new["states"][0], new["states"][1])  # the adapters did move
