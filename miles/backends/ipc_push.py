"""The colocated weight push: a train rank hands its own engines IPC handles of one reused buffer.

With `--colocate` every engine shares a device (and so a host) with train rank `engine % ranks`
(miles.plan.placement_plan). That rank packs each bucket of the update into one flat buffer on
its device and the engine copies it out of the same memory: CUDA IPC on a GPU, shared memory on
the CPU. On a GPU the handle is the buffer pickled by torch's reductions (a `cudaIpcMemHandle`);
on the CPU it names a POSIX shared-memory segment of ours (`Segment`, which says why not torch's).
Either way the rank and the engine run the same code: the handle is made once when the push path
forms and opened once by each engine; after that a push moves only bucket indices.

Protocol, per bucket: the rank gathers the bucket's tensors on its device (a sharded tensor's
`full_tensor()`, a collective every rank walks in the plan's order), casts them into the buffer in
the wire dtype the plan names (`weight_buckets.wire_dtype`), waits for its own stream, and calls
`deliver(index)`, which returns only when every engine of the rank has copied the bucket into its
weights in place and synchronised its own stream. Only then is the buffer reused.

The buffer is as big as the plan's largest bucket (an oversize tensor included), so no bucket
needs a second path; no bytes cross the host on a GPU, and the engine stages nothing.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
import os
import pickle
import secrets
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Callable

import torch
import torch.multiprocessing  # noqa: F401  registers torch's reductions with ForkingPickler

from miles.backends.weight_buckets import BucketPlan, Staging, engine_targets
from miles.backends.fsdp import full_tensor

Deliver = Callable[[int], None]  # bucket index -> returns once every engine has copied it


def buffer_bytes(plan: BucketPlan) -> int:
    """The one buffer a push needs: the largest bucket, oversize ones included."""
    return max((b.nbytes for b in plan.buckets), default=0)


def share(buffer: torch.Tensor) -> bytes:
    """A handle another process of this device rebuilds the same memory from: a CUDA buffer
    pickled by torch's reductions (a cudaIpcMemHandle, released with the last process using it)."""
    return bytes(ForkingPickler.dumps(buffer))


@dataclass(frozen=True)
class Segment:
    """A CPU buffer's handle: a POSIX shared-memory segment of ours. Torch's own (the `file_system`
    strategy) is unlinked by the last process to close it, so an engine killed with its run (Ray
    kills actors; they never close) left it in /dev/shm, in RAM, for good: every CPU run leaked its
    push buffer. Ours loses its name once the engines have mapped it, and goes with the last map."""

    name: str
    nbytes: int


def _map(name: str, nbytes: int, flags: int) -> torch.Tensor:
    fd = _posixshmem.shm_open(name, flags, mode=0o600)
    try:
        if flags & os.O_CREAT:
            os.ftruncate(fd, max(nbytes, 1))
        mapped = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)[:nbytes]  # the tensor keeps the map alive


def new_buffer(nbytes: int, device: torch.device) -> tuple[torch.Tensor, bytes | Segment]:
    """The push buffer on `device` and the handle its engines open it by."""
    if device.type != "cpu":
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer, share(buffer)
    segment = Segment(f"/miles_push_{os.getpid()}_{secrets.token_hex(6)}", nbytes)
    return _map(segment.name, nbytes, os.O_CREAT | os.O_EXCL | os.O_RDWR), segment


def open_shared(handle: bytes | Segment) -> torch.Tensor:
    if isinstance(handle, Segment):
        return _map(handle.name, handle.nbytes, os.O_RDWR)
    return pickle.loads(handle)


def forget_name(handle: bytes | Segment) -> None:
    """No process opens the buffer by its handle again: a CPU segment's name is removed."""
    if isinstance(handle, Segment):
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(handle.name)


def _wait_for_device(t: torch.Tensor) -> None:
    """The other process reads the memory outside this stream's order: finish what is queued."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class IpcSender:
    """A train rank's end: one buffer on its device, shared with each engine it serves."""

    def __init__(self, plan: BucketPlan, device: torch.device):
        self.plan = plan
        self.buffer, self.handle = new_buffer(buffer_bytes(plan), device)
        self.last = Staging()

    def opened(self) -> None:
        """Every engine this rank serves holds the buffer now (or never will)."""
        forget_name(self.handle)

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
