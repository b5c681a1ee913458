"""The colocated weight push: a train rank hands its own engines IPC handles of one reused buffer.

With `--colocate` every engine shares a device (and so a host) with train rank `engine % ranks`
(miles.utils.placement_plan). That rank packs each bucket of the update into one flat buffer on
its device and the engine copies it out of the same memory: CUDA IPC on a GPU, shared memory on
the CPU. Both come from `torch.multiprocessing`'s reductions, so the code is one: the buffer's
handle is the buffer pickled by `ForkingPickler` (a CUDA tensor reduces to a `cudaIpcMemHandle`,
a CPU one, under the `file_system` strategy, to a named shared-memory segment), made once when
the push path forms and rebuilt once by the engine; after that a push moves only bucket indices.

Protocol, per bucket: the rank gathers the bucket's tensors on its device (a sharded tensor's
`full_tensor()`, a collective every rank walks in the plan's order), casts them into the buffer in
the wire dtype the plan names (`weight_buckets.wire_dtype`), waits for its own stream, and calls
`deliver(index)`, which returns only when every engine of the rank has copied the bucket into its
weights in place and synchronised its own stream. Only then is the buffer reused.

The buffer is as big as the plan's largest bucket (an oversize tensor included), so no bucket
needs a second path; no bytes cross the host on a GPU, and the engine stages nothing.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Callable, Iterator

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its reductions here

from miles.backends.weight_buckets import BucketPlan, Staging, engine_targets
from miles.backends.fsdp import full_tensor

Deliver = Callable[[int], None]  # bucket index -> returns once every engine has copied it


def buffer_bytes(plan: BucketPlan) -> int:
    """The one buffer a push needs: the largest bucket, oversize ones included."""
    return max((b.nbytes for b in plan.buckets), default=0)


@contextlib.contextmanager
def _shared_by_name() -> Iterator[None]:
    """CPU storages reduce to a named segment any process of the host can open (the default,
    `file_descriptor`, passes the fd over a socket keyed by the parent's authkey, which two
    Ray workers do not share). CUDA storages ignore the strategy."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def share(buffer: torch.Tensor) -> bytes:
    """A handle another process of this host (device) rebuilds the same memory from."""
    with _shared_by_name():
        return bytes(ForkingPickler.dumps(buffer))


def open_shared(handle: bytes) -> torch.Tensor:
    return pickle.loads(handle)


def _wait_for_device(t: torch.Tensor) -> None:
    """The other process reads the memory outside this stream's order: finish what is queued."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class IpcSender:
    """A train rank's end: one buffer on its device, shared with each engine it serves."""

    def __init__(self, plan: BucketPlan, device: torch.device):
        self.plan = plan
        self.buffer = torch.empty(buffer_bytes(plan), dtype=torch.uint8, device=device)
        self.handle = share(self.buffer)
        self.last = Staging()

    @torch.no_grad()
    def send(self, tensors: dict[tuple[str, str], torch.Tensor], deliver: Deliver) -> Staging:
        staging = Staging()
        staging.hold(self.buffer.numel())
        for index, bucket in enumerate(self.plan.buckets):
            dtype = getattr(torch, bucket.dtype)
            for slot in bucket.slots:
                full = full_tensor(tensors[slot.component, slot.name])
                gathered = 0 if full is tensors[slot.component, slot.name] else slot.nbytes
                staging.hold(gathered)
                self.buffer[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape).copy_(full)
                del full
                staging.release(gathered)
            _wait_for_device(self.buffer)
            deliver(index)
        self.last = staging
        return staging


class IpcReceiver:
    """An engine's end: the rank's buffer, rebuilt from its handle, copied out of bucket by bucket."""

    def __init__(self, handle: bytes, plan: BucketPlan, parts: dict[str, torch.nn.Module | None]):
        self.plan, self.parts = plan, parts
        engine_targets(parts, plan)  # a name or shape mismatch fails before the first push
        self.buffer = open_shared(handle)
        self.targets: dict[tuple[str, str], torch.Tensor] = {}

    def begin(self) -> None:
        # looked up afresh for each push: moving a module (offload) may swap its parameters' tensors
        self.targets = engine_targets(self.parts, self.plan)

    @torch.no_grad()
    def receive(self, index: int) -> None:
        bucket = self.plan.buckets[index]
        dtype = getattr(torch, bucket.dtype)
        for slot in bucket.slots:
            target = self.targets[slot.component, slot.name]
            target.copy_(self.buffer[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape))
        _wait_for_device(self.buffer)  # the copy is done before the rank may overwrite the buffer
