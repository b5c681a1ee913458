"""The weight-sync process group: train rank 0 (rank 0 here, the sender) and every engine.

The train ranks already own the default torch.distributed group among themselves, and an engine
belongs to none, so this group is built apart from it: a `TCPStore` hosted by the sender and a
process group constructed directly on it (`ProcessGroupGloo` / `ProcessGroupNCCL`), never
registered as the default. Its collectives are called on the group object itself.

Backend. NCCL on GPUs, unless an engine shares a GPU with the sender (`--colocate`): NCCL refuses
two ranks on one device, so such a group is gloo with the buckets staged in host memory, still at
most one bucket at a time. On the CPU, gloo.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.backends.weight_buckets import BucketPlan, Staging, engine_targets, receive_buckets, send_buckets

SENDER = 0
_STORE_PREFIX = "miles-weight-sync"


@dataclass(frozen=True)
class SyncGroupAddress:
    """Where the group meets and who is in it (crosses to every member)."""

    host: str
    port: int
    world_size: int  # the sender + one rank per engine
    backend: str  # "gloo" or "nccl"
    timeout_s: float


def sync_backend(device: str, colocate: bool) -> str:
    return "nccl" if device == "cuda" and not colocate else "gloo"


def buffer_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def open_group(address: SyncGroupAddress, rank: int, store: dist.TCPStore | None = None):
    """Join the group (every member at once: the group's set-up waits for all of them); the sender
    passes the store it hosts already (`host_store`), if it made one."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    if store is None:
        store = dist.TCPStore(address.host, address.port, address.world_size, is_master=rank == SENDER,
                              timeout=timeout)
    prefixed = dist.PrefixStore(_STORE_PREFIX, store)
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    raise ValueError(f"weight sync backend {address.backend!r}: supported gloo, nccl")


class WeightSender:
    """Train rank 0's end: packs and broadcasts the buckets of each update."""

    def __init__(self, address: SyncGroupAddress, plan: BucketPlan, store: dist.TCPStore | None = None):
        self.plan = plan
        self.group = open_group(address, SENDER, store)
        self.device = buffer_device(address.backend)
        self.last = Staging()

    def send(self, tensors: dict[tuple[str, str], torch.Tensor]) -> Staging:
        self.last = send_buckets(self.plan, tensors, self._broadcast, self.device)
        return self.last

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, SENDER).wait()


class WeightReceiver:
    """An engine's end: receives each bucket and copies it into the engine's tensors in place."""

    def __init__(self, address: SyncGroupAddress, rank: int, plan: BucketPlan,
                 parts: dict[str, torch.nn.Module | None]):
        self.plan, self.parts = plan, parts
        engine_targets(parts, plan)  # a name or shape mismatch fails before the group forms
        self.group = open_group(address, rank)
        self.device = buffer_device(address.backend)
        self.last = Staging()

    def receive(self) -> Staging:
        # looked up afresh each time: moving a module (offload) may swap its parameters' tensors
        self.last = receive_buckets(self.plan, engine_targets(self.parts, self.plan), self._broadcast, self.device)
        return self.last

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, SENDER).wait()
