"""The sharded ranks of tests/unit/backends/test_fsdp.py: spawned processes over one gloo group.

`two_rank_run` is one rank's whole story, so one process-group start serves every assertion:
train rollout 0 (parity), gather the weights, round-trip the offloaded state, push the weights to
an engine (rank 0's) that samples rollout 1, save, train rollout 1, then a fresh rank object loads
the checkpoint and trains rollout 1 again. Rank 0 writes what the test compares to `result.pt`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dtype_helpers import engine_for, one_rollout, tiny_args


def fsdp_args(run_dir, extra: str, ranks: int):
    return tiny_args(run_dir, f"{extra} --train-backend fsdp --actor-num-gpus-per-node {ranks} "
                              f"--num-gpus-per-node {ranks}")


def local_state(rank) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and the optimizer state, copied."""
    out = {f"param/{n}": p.detach().to_local().clone() for n, p in rank.params.items()}
    for p, state in rank.optimizer.state.items():
        for key, value in state.items():
            out[f"optim/{id(p)}/{key}"] = (value.to_local() if hasattr(value, "to_local") else value).clone()
    return out


def optimizer_state(rank) -> dict[str, torch.Tensor]:
    """The AdamW state by parameter name, whole tensors (a collective)."""
    from miles.backends.fsdp import full_tensor

    names = {id(p): n for n, p in rank.params.items()}
    return {f"{names[id(p)]}/{k}": full_tensor(v).clone() for p, s in rank.optimizer.state.items() for k, v in s.items()}


def offload_round_trip(rank) -> dict:
    from miles.backends.train_offload import resident
    from miles.models.offload import resident_bytes

    with resident(rank.offload, optimizer=True):
        before = local_state(rank)
    tensors = rank.offload.model_tensors() + rank.offload.optimizer_tensors()
    offloaded_bytes = resident_bytes(tensors)
    with resident(rank.offload, optimizer=True):
        after = local_state(rank)
        reloaded_bytes = resident_bytes(tensors)
    same = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    return {"offloaded_bytes": offloaded_bytes, "reloaded_bytes": reloaded_bytes, "round_trip_equal": same,
            "tensors": len(before)}


def two_rank_run(rank_id: int, port: int, run_dir: str, flags: str, batch_path: str) -> None:
    from miles.backends.actor import TrainRank

    out = Path(run_dir)
    args, plan = fsdp_args(out / f"run{rank_id}", flags, 2)
    rank = TrainRank(args, plan, rank_id, 2)
    rank.setup("127.0.0.1", port)
    result = {"param_types": sorted({type(p).__name__ for p in rank.params.values()})}
    batch0 = torch.load(batch_path, weights_only=False)
    result["metrics0"] = rank.train(batch0).metrics
    result["state0"] = rank.trained_state()
    result["offload"] = offload_round_trip(rank)

    updates = rank.weight_updates()  # every rank gathers; rank 0's engine samples the next rollout
    batch1 = [None]
    if rank_id == 0:
        engine = engine_for(args)
        result["engine_offloaded_at_start"] = False
        for update in updates:
            engine.load_weights(update.component, update.state_dict)
        batch1 = [one_rollout(args, 1, engine)]
        result["engine_offloaded_after_generate"] = engine.offloaded_weights.weights.offloaded
    dist.broadcast_object_list(batch1, src=0)
    staging = out / "ckpt"
    if rank_id == 0:
        staging.mkdir()
    dist.barrier()
    rank.save(str(staging))
    dist.barrier()
    result["metrics1"] = rank.train(batch1[0]).metrics
    result["state1"], result["optim1"] = rank.trained_state(), rank_optimizer(rank)

    resumed = TrainRank(args, plan, rank_id, 2)
    resumed.setup()  # the process already has the group
    resumed.load(str(staging))
    result["resumed_step"] = resumed.optimizer_step
    result["metrics1_resumed"] = resumed.train(batch1[0]).metrics
    result["state1_resumed"], result["optim1_resumed"] = resumed.trained_state(), rank_optimizer(resumed)
    result["hsdp"] = hsdp_run(rank_id, out, flags, batch0)
    if rank_id == 0:
        torch.save(result, out / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


def hsdp_run(rank_id: int, out: Path, flags: str, batch) -> dict:
    """The same rollout on a fresh rank of --dp-replicate-size 2: two replicas of one shard each
    (the process group is the one above); every rank's weights after the step are gathered to rank 0."""
    from miles.backends.actor import TrainRank

    args, plan = fsdp_args(out / f"hsdp{rank_id}", f"{flags} --dp-replicate-size 2", 2)
    rank = TrainRank(args, plan, rank_id, 2)
    rank.setup()
    result = {"placements": sorted({str(p.placements) for p in rank.params.values()}),
              "local_is_whole": all(p.to_local().shape == p.shape for p in rank.params.values())}
    result["metrics"] = rank.train(batch).metrics
    from miles.backends.train_offload import resident

    states = [None, None]
    with resident(rank.offload, optimizer=False):  # offloaded between steps: its tensors are read back first
        dist.all_gather_object(states, {n: p.detach().to_local().clone() for n, p in rank.params.items()})
    result["local_states"], result["state"] = states, rank.trained_state()
    return result


def rank_optimizer(rank) -> dict[str, torch.Tensor]:
    from miles.backends.train_offload import resident

    with resident(rank.offload, optimizer=True):
        return optimizer_state(rank)

