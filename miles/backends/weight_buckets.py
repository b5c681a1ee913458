"""Trained weights in fixed-size buckets: the plan, packing on the sender, unpacking on a receiver.

Pure tensor code; the process group that carries the buckets is `miles.backends.sync_group`.

Order, the same on every process: `weight_sync.synced_tensors`' order (the synced components in
order, each one's `named_parameters()`; LoRA: the adapter tensors only), then
grouped by wire dtype, stably (the dtype met first goes first). Consecutive tensors of one dtype
fill a bucket of at most `buffer_bytes`; a tensor bigger than the buffer is a bucket of its own.

Wire dtype. A floating tensor travels in the dtype the engine holds it in (miles.models.precision:
--rollout-dtype, float32 for a module its class keeps in float32): the sender casts it while
copying it into the buffer, the same round-to-nearest cast the object-store path's
engine applied on arrival (`Tensor.to`), so the engine gets the same bits from half the bytes
when the trainer holds a wider dtype.

Sharded tensors (DTensor, FSDP2) are gathered one at a time with `.full_tensor()` while the
bucket fills, so no rank ever holds more than one bucket plus one gathered tensor. Gathering is
a collective: every train rank walks the same order, only the sender packs.

Staging. The sender reuses one byte buffer for every bucket (a tensor bigger than the buffer is
sent as itself when it already has the wire dtype and layout, else as one converted copy); a
receiver likewise, and receives a big tensor straight into the engine's own tensor when it can.
`Staging` counts the bytes of those buffers while they live; tests assert its peak.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Callable

import torch

from miles.backends.fsdp import full_tensor

Transfer = Callable[[torch.Tensor], None]  # broadcasts a uint8 tensor: sends it, or fills it


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket (crosses to the engines inside a `BucketPlan`)."""

    component: str
    name: str
    shape: tuple[int, ...]
    offset: int  # bytes from the bucket's start
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    dtype: str  # wire dtype, a torch attribute name ("bfloat16")
    nbytes: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class BucketPlan:
    """Every bucket of one weight update, in send order; the same plan on sender and receivers."""

    buffer_bytes: int
    buckets: tuple[Bucket, ...]

    def oversize(self, bucket: Bucket) -> bool:
        return bucket.nbytes > self.buffer_bytes

    @property
    def shared_buffer_bytes(self) -> int:
        """Size of the one buffer reused for every bucket that fits the buffer size."""
        return max((b.nbytes for b in self.buckets if not self.oversize(b)), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass
class Staging:
    """Bytes of staging tensors alive now, and the most ever alive at once."""

    held: int = 0
    peak: int = 0

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


# (component, tensor name, the sender's dtype) -> the dtype the engine holds it in (miles.backends.weight_sync.wire_rule)
WireRule = Callable[[str, str, torch.dtype], torch.dtype]


def wire_dtype(component: str, name: str, dtype: torch.dtype, engine: torch.dtype | WireRule) -> torch.dtype:
    """The one question the push asks: what tensor `name` travels in. `engine`: one dtype for every
    floating tensor, or the rule per tensor."""
    if callable(engine):
        return engine(component, name, dtype)
    return engine if dtype.is_floating_point else dtype


def plan_buckets(tensors: list[tuple[str, str, torch.Tensor]], engine_dtype: torch.dtype | WireRule,
                 buffer_bytes: int) -> BucketPlan:
    if buffer_bytes <= 0:
        raise ValueError(f"--update-weight-buffer-size must be > 0 bytes, got {buffer_bytes}")
    by_dtype: dict[torch.dtype, list[tuple[str, str, tuple[int, ...]]]] = {}
    for component, name, t in tensors:
        by_dtype.setdefault(wire_dtype(component, name, t.dtype, engine_dtype), []).append(
            (component, name, tuple(t.shape)))
    buckets: list[Bucket] = []
    for dtype, entries in by_dtype.items():
        buckets += _fill(dtype, entries, buffer_bytes)
    return BucketPlan(buffer_bytes, tuple(buckets))


def _fill(dtype: torch.dtype, entries: list[tuple[str, str, tuple[int, ...]]], buffer_bytes: int) -> list[Bucket]:
    name = str(dtype).removeprefix("torch.")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buckets, slots, used = [], [], 0
    for component, tensor_name, shape in entries:
        nbytes = itemsize * math.prod(shape)
        if slots and used + nbytes > buffer_bytes:
            buckets.append(Bucket(name, used, tuple(slots)))
            slots, used = [], 0
        slots.append(Slot(component, tensor_name, shape, used, nbytes))
        used += nbytes  # a tensor bigger than the buffer lands here alone and closes its bucket next
    if slots:
        buckets.append(Bucket(name, used, tuple(slots)))
    return buckets


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _gathered(t: torch.Tensor, staging: Staging) -> tuple[torch.Tensor, int]:
    """The whole tensor on this rank, and the bytes gathering it allocated (0 for a plain one)."""
    full = full_tensor(t)
    if full is t:
        return t, 0
    nbytes = full.numel() * full.element_size()
    staging.hold(nbytes)
    return full, nbytes


def _with_shared_buffer(plan: BucketPlan, device: torch.device, staging: Staging, allocate: bool = True):
    """Each bucket in order, with its dtype and the one buffer every bucket that fits is packed in:
    made (and held in `staging`) when the first such bucket comes, so a plan of oversize buckets
    alone never makes it; None until then, and always with allocate=False."""
    buffer = None
    for bucket in plan.buckets:
        if buffer is None and allocate and not plan.oversize(bucket):
            buffer = torch.empty(plan.shared_buffer_bytes, dtype=torch.uint8, device=device)
            staging.hold(buffer.numel())
        yield bucket, getattr(torch, bucket.dtype), buffer


def send_buckets(plan: BucketPlan, tensors: dict[tuple[str, str], torch.Tensor], send: Transfer | None,
                 device: torch.device, staging: Staging | None = None) -> Staging:
    """Pack and send every bucket in order. `send=None` (a train rank other than the sender) only
    takes part in the gathers of sharded tensors, so the sender's gathers can complete."""
    staging = staging or Staging()
    for bucket, dtype, buffer in _with_shared_buffer(plan, device, staging, allocate=send is not None):
        if plan.oversize(bucket):
            _send_alone(bucket, dtype, tensors, send, device, staging)
            continue
        for slot in bucket.slots:
            full, gathered = _gathered(tensors[slot.component, slot.name], staging)
            if send is not None:
                buffer[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape).copy_(full)
            staging.release(gathered)
        if send is not None:
            send(buffer[:bucket.nbytes])
    return staging


def _send_alone(bucket: Bucket, dtype: torch.dtype, tensors, send: Transfer | None, device: torch.device,
                staging: Staging) -> None:
    """A tensor bigger than the buffer: sent as itself, or as one copy in the wire dtype and device."""
    (slot,) = bucket.slots
    full, gathered = _gathered(tensors[slot.component, slot.name], staging)
    if send is not None:
        ready = full.dtype == dtype and full.device == device and full.is_contiguous()
        wire = full if ready else full.to(device=device, dtype=dtype).contiguous()
        copied = 0 if ready else slot.nbytes
        staging.hold(copied)
        send(_as_bytes(wire))
        staging.release(copied)
    staging.release(gathered)


def engine_targets(parts: dict[str, torch.nn.Module | None], plan: BucketPlan) -> dict[tuple[str, str], torch.Tensor]:
    """The engine's own tensor of every slot (aliases of its parameters: filling them updates the
    model in place). Names and shapes are checked before the first bucket moves."""
    targets, states = {}, {}
    for bucket in plan.buckets:
        for slot in bucket.slots:
            module = parts.get(slot.component)
            if module is None:
                raise KeyError(f"weight sync names component {slot.component!r}, which this engine lacks")
            if slot.component not in states:  # once per component (setdefault would build it per slot)
                states[slot.component] = module.state_dict(keep_vars=False)
            own = states[slot.component]
            if slot.name not in own:
                raise KeyError(f"component {slot.component!r} has no tensor {slot.name!r}")
            if tuple(own[slot.name].shape) != slot.shape:
                raise ValueError(f"component {slot.component!r}: tensor {slot.name!r} has shape "
                                 f"{list(own[slot.name].shape)}, the trainer sends {list(slot.shape)}")
            targets[slot.component, slot.name] = own[slot.name]
    return targets


@torch.no_grad()
def receive_buckets(plan: BucketPlan, targets: dict[tuple[str, str], torch.Tensor], receive: Transfer,
                    device: torch.device, staging: Staging | None = None) -> Staging:
    """Receive every bucket in order and copy each slot into its engine tensor, cast to its dtype."""
    staging = staging or Staging()
    for bucket, dtype, buffer in _with_shared_buffer(plan, device, staging):
        if plan.oversize(bucket):
            _receive_alone(bucket, dtype, targets, receive, device, staging)
            continue
        receive(buffer[:bucket.nbytes])
        for slot in bucket.slots:
            targets[slot.component, slot.name].copy_(
                buffer[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape))
    return staging


def _receive_alone(bucket: Bucket, dtype: torch.dtype, targets, receive: Transfer, device: torch.device,
                   staging: Staging) -> None:
    (slot,) = bucket.slots
    target = targets[slot.component, slot.name]
    if target.dtype == dtype and target.device == device and target.is_contiguous():
        receive(_as_bytes(target))  # straight into the engine's tensor: no staging at all
        return
    landing = torch.empty(slot.nbytes, dtype=torch.uint8, device=device)
    staging.hold(slot.nbytes)
    receive(landing)
    target.copy_(landing.view(dtype).view(slot.shape))
    staging.release(slot.nbytes)
