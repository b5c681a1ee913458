"""Pushing the trainer's weights into the engines after each optimizer phase (`--weight-sync`).

`bucketed` (default): the trained tensors move in buckets of at most `--update-weight-buffer-size`
bytes, so no process stages more than one bucket beyond its weights, whatever the model's size.
With `--colocate` each train rank hands its own engines IPC handles of one reused buffer on its
device (miles.backends.ipc_push: CUDA IPC on a GPU, shared memory on the CPU); otherwise train
rank 0 and every engine form one torch.distributed group (miles.backends.sync_group) and each
push broadcasts the buckets (NCCL, device to device, on GPUs). `object-store`: rank 0 copies every
trained tensor to host memory and puts it in Ray's object store, each engine fetches the whole
state dict (the path before buckets; simple, and whole-model copies on every side).

LoRA goes through the same path as full weights: its plan carries the adapter tensors only, which
usually make one bucket and one broadcast, cheaper than a put and a fetch per engine; and one
path for both means every LoRA run also exercises the group that full-weight runs depend on.
"""

from __future__ import annotations

import time

from miles.backends.sync_group import SyncGroupAddress, sync_backend
from miles.ray.faults import wait_for


class ObjectStoreSync:
    def __init__(self, trainer, rollout):
        self.trainer, self.rollout = trainer, rollout

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        self.rollout.update_weights(self.trainer.weight_update_refs())
        return {"perf/weight_sync_time": time.perf_counter() - start}


def push_transport(args) -> str:
    """`ipc` when every engine shares a device with a train rank (--colocate), else `broadcast`."""
    return "ipc" if args.colocate else "broadcast"


def serving_rank(engine: int, ranks: int) -> int:
    """The train rank a colocated engine shares its device with (miles.plan.placement_plan)."""
    return engine % ranks


class BucketedSync:
    """The push path of train ranks and engines, formed once; `push()` moves one update. Colocated
    engines each get their own train rank's buffer through IPC handles (miles.backends.ipc_push);
    the others form one broadcast group with train rank 0 (miles.backends.sync_group)."""

    def __init__(self, args, trainer, rollout):
        self.trainer, self.engines = trainer, rollout.engines
        self.transport = push_transport(args)
        rank0 = trainer.actors[:1]
        self.plan = wait_for([rank0[0].weight_bucket_plan.remote(args.update_weight_buffer_size)], rank0,
                             "weight_bucket_plan")[0]
        if self.transport == "ipc":
            self.receivers: list = []  # each engine is driven by its train rank
            served = [[e for i, e in enumerate(self.engines) if serving_rank(i, len(trainer.actors)) == r]
                      for r in range(len(trainer.actors))]
            joins = [a.join_weight_sync.remote(None, self.plan, mine) for a, mine in zip(trainer.actors, served)]
            wait_for(joins, trainer.actors + self.engines, "join_weight_sync")
            return
        self.receivers = self.engines
        host, port = wait_for([rank0[0].weight_sync_address.remote()], rank0, "weight_sync_address")[0]
        self.address = SyncGroupAddress(host, port, 1 + len(self.engines), sync_backend(args.device, args.colocate),
                                        args.remote_timeout_s)
        joins = [a.join_weight_sync.remote(self.address, self.plan) for a in trainer.actors]
        joins += [e.join_weight_sync.remote(self.address, 1 + i, self.plan) for i, e in enumerate(self.engines)]
        wait_for(joins, trainer.actors + self.engines, "join_weight_sync")

    def push(self) -> dict[str, float]:
        """Every train rank (gathers of sharded tensors are collectives) and every broadcast engine at
        once. Metrics: the time, and the most staging bytes a sender or an engine held at once (an
        IPC engine stages nothing: it copies out of its rank's buffer)."""
        start = time.perf_counter()
        senders = [a.send_weights.remote() for a in self.trainer.actors]
        receivers = [e.receive_weights.remote() for e in self.receivers]
        peaks = wait_for(senders + receivers, self.trainer.actors + self.engines, "sync_weights")
        return {"perf/weight_sync_time": time.perf_counter() - start,
                "perf/weight_sync_sender_staging_bytes": max(peaks[:len(senders)]),
                "perf/weight_sync_engine_staging_bytes": max(peaks[len(senders):], default=0),
                "perf/weight_sync_bytes": self.plan.total_bytes,
                "perf/weight_sync_ipc": float(self.transport == "ipc")}


def connect_weight_sync(args, trainer, rollout) -> ObjectStoreSync | BucketedSync:
    if args.weight_sync == "bucketed":
        return BucketedSync(args, trainer, rollout)
    return ObjectStoreSync(trainer, rollout)
