"""Bucketed weight sync between real processes over gloo, with FSDP2-sharded train ranks.

Three processes: two train ranks (their own default group, the model sharded with `fully_shard`,
so every parameter is a DTensor) and one engine. Train rank 0 and the engine form the weight-sync
group apart from the default one; train rank 1 only takes part in the gathers. A full-weight sync
and a LoRA sync must deliver to the engine exactly the bits the object-store path delivers.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from miles.backends.sync_group import SyncGroupAddress, WeightReceiver, WeightSender
from miles.backends.weight_buckets import plan_buckets, send_buckets
from miles.backends.weight_sync import apply_weight_update, collect_weight_updates, synced_tensors
from miles.launcher.ray_cluster import free_ports
from process_start import process_context
from weight_sync_models import LoraLike, bit_equal, perturbed, state

BUFFER = 512  # bytes: far below the model, so the sync takes many buckets and one oversize tensor
BLOCKS = 6


def trained(lora: bool) -> torch.nn.Module:
    return perturbed(LoraLike(blocks=BLOCKS, lora_rank=2 if lora else 0), seed=7)


def train_rank(rank: int, ports: list[int], out: Path, plans) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
    for phase, lora in enumerate((False, True)):
        model = trained(lora)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        tensors = synced_tensors({"transformer": model}, ["transformer"], lora_only=lora)
        assert all(type(t).__name__ == "DTensor" for _, _, t in tensors)
        plan = plan_buckets(tensors, torch.float32, BUFFER)
        by_name = {(c, n): t for c, n, t in tensors}
        if rank == 0:
            plans.put(plan)
            address = SyncGroupAddress("127.0.0.1", ports[1 + phase], 2, "gloo", 60.0)
            staging = WeightSender(address, plan).send(by_name)
        else:
            staging = send_buckets(plan, by_name, None, torch.device("cpu"))
        torch.save({"peak": staging.peak, "plan": plan}, out / f"rank{rank}_phase{phase}.pt")
    dist.destroy_process_group()


def engine(ports: list[int], out: Path, plans) -> None:
    for phase, lora in enumerate((False, True)):
        model = LoraLike(blocks=BLOCKS, lora_rank=2 if lora else 0)
        address = SyncGroupAddress("127.0.0.1", ports[1 + phase], 2, "gloo", 60.0)
        receiver = WeightReceiver(address, 1, plans.get(timeout=60), {"transformer": model})
        staging = receiver.receive()
        torch.save({"peak": staging.peak, "state": state(model)}, out / f"engine_phase{phase}.pt")


def guarded(fn, *args) -> None:
    try:
        torch.set_num_threads(1)
        fn(*args)
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)


def test_sharded_ranks_deliver_full_and_lora_weights_with_the_object_store_paths_bits(tmp_path, worker_ray):
    ports = free_ports(3)
    ctx = process_context(ray_ran_here=worker_ray.starts > 0)
    plans = ctx.Queue()
    procs = [ctx.Process(target=guarded, args=(train_rank, r, ports, tmp_path, plans)) for r in (0, 1)]
    procs.append(ctx.Process(target=guarded, args=(engine, ports, tmp_path, plans)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0]

    for phase, lora in enumerate((False, True)):
        got = torch.load(tmp_path / f"engine_phase{phase}.pt")
        expected = LoraLike(blocks=BLOCKS, lora_rank=2 if lora else 0)
        (update,) = collect_weight_updates({"transformer": trained(lora)}, ["transformer"], lora_only=lora)
        apply_weight_update(expected, update.state_dict)  # what the object-store path gives the engine
        assert bit_equal(got["state"], state(expected)), f"phase {phase}"
        assert not bit_equal(got["state"], state(LoraLike(blocks=BLOCKS, lora_rank=2 if lora else 0)))

        sender = torch.load(tmp_path / f"rank0_phase{phase}.pt", weights_only=False)
        plan = sender["plan"]
        largest = max(s.nbytes for b in plan.buckets for s in b.slots)
        # one bucket plus the one tensor being gathered: never the whole model
        assert 0 < sender["peak"] <= plan.shared_buffer_bytes + largest < plan.total_bytes or lora
        assert got["peak"] <= max(b.nbytes for b in plan.buckets)
        other = torch.load(tmp_path / f"rank1_phase{phase}.pt", weights_only=False)
        assert other["peak"] <= largest  # it gathered, one tensor at a time, and packed nothing
