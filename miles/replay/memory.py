"""Live bytes of every tensor the replayed code makes, by place (a GPU or the host) and role.

The replay runs the project's code on the meta device: every tensor has a shape and a dtype and
no storage, so a phase at the released sizes costs no memory and no arithmetic. `LiveMemory` is
a `TorchDispatchMode`: at every op it sees each new storage, charges its bytes to the place and
role the replay says is running (`at(...)`), and uncharges them when the storage is freed (a
weakref callback). What torch's own tools lack is only the place: a meta tensor does not know
whether the real run would have it on a GPU or in host memory. So:

- the code's device (`torch.device("meta")` where the run has "cuda") is the role's GPU;
- a copy to the CPU (`.cpu()`, `.to("cpu")`, a factory op asking for the CPU) is made on meta
  too and charged to the host, except inside FSDP2, whose own buffers follow its mesh's device
  type (the replay's mesh is a CPU mesh over a fake process group): they are the GPU's;
- what the real run itself builds on meta (a sharded trainer's empty transformer, before each
  rank fills its rows) is charged nowhere (`UNPLACED`), and so is what is made from it alone;
- an op's other outputs are where its inputs are (on the GPU if any input is).

A host tensor moved to the device (`x.to(device)`, a module's `.to(device)`) is no copy on meta (it
is already there): `moved_to_device` (miles.replay.seams) makes it one, on the role's GPU.

Scalars read from a meta tensor (`float(loss)`) are 0: no value is ever computed.
"""

from __future__ import annotations

import heapq
import math
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor as _DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from miles.replay.meta_outputs import META_OUTPUTS, is_view

HOST = "host"
# the places and roles of the replay's report
TRAIN_GPU, ROLLOUT_GPU, REWARD_GPU = "train GPU", "rollout GPU", "reward GPU"
RANK, ENGINE, REWARD = "train rank", "engine", "reward worker"
UNPLACED = "meta in the real run"  # what the real run itself builds on meta: no bytes anywhere
_FSDP_FILES = ("/torch/distributed/fsdp/", "/torch/distributed/_composable/")
_SNAPSHOT_STEP = 1.05  # a new top-tensors snapshot when a role's peak grows by 5 %
_TOP = 6


@dataclass
class Allocation:
    nbytes: int
    place: str
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    op: str
    name: str = ""  # set when the replay names the live storages (parameters, optimizer state)


@dataclass
class Segment:
    """A stretch of a phase between two marks (`LiveMemory.mark`): per (place, role) the most held."""

    label: str
    peak: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass
class PhaseRecord:
    """One phase: per (place, role) the bytes at its start and the most held during it, and the
    most held in each of its segments (the phase's peak is their maximum)."""

    name: str
    start: dict[tuple[str, str], int] = field(default_factory=dict)
    peak: dict[tuple[str, str], int] = field(default_factory=dict)
    top: dict[tuple[str, str], list[tuple[int, Allocation, int]]] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)

    def roles(self, place: str) -> list[str]:
        return sorted({r for p, r in {**self.start, **self.peak} if p == place})

    def place_peak(self, place: str) -> int:
        """The processes of one place run at once: each role's own rise above its start adds up."""
        keys = [(place, r) for r in self.roles(place)]
        base = sum(self.start.get(k, 0) for k in keys)
        return base + sum(max(0, self.peak.get(k, 0) - self.start.get(k, 0)) for k in keys)

    def role_share(self, place: str, role: str) -> int:
        k = (place, role)
        return self.start.get(k, 0) + max(0, self.peak.get(k, 0) - self.start.get(k, 0))


class LiveMemory:
    def __init__(self):
        self.live: dict[int, Allocation] = {}
        self._watched: dict[int, weakref.ref] = {}  # a weakref per live storage: its callback uncharges it
        self.by_role: dict[tuple[str, str], dict[int, Allocation]] = {}
        self.totals: dict[tuple[str, str], int] = {}
        self.place, self.role = HOST, "driver"
        self.forced: str | None = None  # a place every new storage goes to (a host tensor moved to the device)
        self.phase: PhaseRecord | None = None
        self.phases: list[PhaseRecord] = []
        self._snapshot_at: dict[tuple[str, str], int] = {}
        self.mode = _Mode(self)

    # -- what runs where ----------------------------------------------------------------------

    @contextmanager
    def at(self, place: str, role: str):
        saved = self.place, self.role
        self.place, self.role = place, role
        try:
            yield
        finally:
            self.place, self.role = saved

    @contextmanager
    def measuring(self, name: str):
        record = PhaseRecord(name, start=dict(self.totals), peak=dict(self.totals),
                             segments=[Segment(name, dict(self.totals))])
        self.phase, self._snapshot_at = record, {}
        try:
            yield record
        finally:
            self.phases.append(record)
            self.phase = None

    def mark(self, label: str) -> None:
        """Start a new segment of the phase being measured (if one is): a point the code reaches
        the same number of times at every depth (a component's load), so that a segment's peak
        is a moment the replays at two depths share (miles.replay.run, Depth)."""
        if self.phase is not None:
            self.phase.segments.append(Segment(label, dict(self.totals)))

    def held(self, place: str, role: str | None = None) -> int:
        return sum(v for (p, r), v in self.totals.items() if p == place and (role is None or r == role))

    # -- accounting -----------------------------------------------------------------------------

    def charge(self, tensor: torch.Tensor, place: str, op: str, storage: torch.UntypedStorage | None = None) -> None:
        if storage is None:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass: its inner tensors are counted
                return
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self.live or nbytes == 0:
            return
        alloc = Allocation(nbytes, place, self.role, tuple(tensor.shape), tensor.dtype, op)
        self.live[key] = alloc
        self.by_role.setdefault((place, self.role), {})[key] = alloc
        self._add((place, self.role), nbytes)
        self._watched[key] = weakref.ref(storage, lambda _, key=key: self._free(key))

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place (offload frees one by resizing it to 0 and back)."""
        key = storage._cdata
        alloc = self.live.get(key)
        if alloc is None:  # a storage not seen yet: charged whole, as a tensor over all of it
            self.charge(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), self.place,
                        "resize_")
            return
        delta = storage.nbytes() - alloc.nbytes
        alloc.nbytes = storage.nbytes()
        self._add((alloc.place, alloc.role), delta)

    def _add(self, key: tuple[str, str], nbytes: int) -> None:
        self.totals[key] = self.totals.get(key, 0) + nbytes
        phase = self.phase
        if phase is None:
            return
        segment = phase.segments[-1].peak
        if self.totals[key] > segment.get(key, 0):
            segment[key] = self.totals[key]
        if self.totals[key] > phase.peak.get(key, 0):
            phase.peak[key] = self.totals[key]
            if self.totals[key] >= self._snapshot_at.get(key, 0) * _SNAPSHOT_STEP:
                self._snapshot_at[key] = self.totals[key]
                phase.top[key] = self.largest(key)

    def _free(self, key: int) -> None:
        self._watched.pop(key, None)
        alloc = self.live.pop(key, None)
        if alloc is not None:
            self.by_role[(alloc.place, alloc.role)].pop(key, None)
            self._add((alloc.place, alloc.role), -alloc.nbytes)

    def largest(self, key: tuple[str, str], n: int = _TOP) -> list[tuple[int, Allocation, int]]:
        """(storage key, allocation, its bytes now) of the role's largest live storages."""
        return heapq.nlargest(n, ((k, a, a.nbytes) for k, a in self.by_role.get(key, {}).items()),
                              key=lambda item: item[2])

    def place_of(self, tensor: torch.Tensor) -> str | None:
        alloc = self.live.get(_key(tensor))
        return None if alloc is None else alloc.place

    @contextmanager
    def forcing(self, place: str):
        saved, self.forced = self.forced, place
        try:
            yield
        finally:
            self.forced = saved

    # -- names ----------------------------------------------------------------------------------

    def name_storages(self, named: dict[str, torch.Tensor]) -> None:
        """Name the live storage of each tensor (parameters, gradients, optimizer state)."""
        for name, tensor in named.items():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            try:
                alloc = self.live.get(local.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                continue
            if alloc is not None and not alloc.name:
                alloc.name = name

    def describe(self, alloc: Allocation, nbytes: int) -> str:
        name = alloc.name or f"(made by {alloc.op})"
        dtype = str(alloc.dtype).removeprefix("torch.")
        return f"{name} {list(alloc.shape)} {dtype} {nbytes / 2**30:.2f} GiB"


_FACTORY_TO_CPU = {torch.ops.aten._to_copy.default, torch.ops.aten.empty.memory_format,
                   torch.ops.aten.empty_strided.default}


def _wants_cpu(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _empty_request(func, args) -> bool:
    """A factory op for no elements (the start of a view of an existing host storage): left real."""
    return func is torch.ops.aten.empty.memory_format and math.prod(args[0]) == 0


def _inside_fsdp() -> bool:
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if any(part in frame.f_code.co_filename for part in _FSDP_FILES):
            return True
        frame = frame.f_back
    return False


_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE


def _faking() -> bool:
    """Whether a FakeTensorMode is on: torch runs it after the user modes (this one), so this mode
    sees the calls it is about to make fake."""
    return torch._C._get_dispatch_mode(_FAKE_KEY) is not None


def _to_meta(x):
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
        return x.to("meta")
    return x


class _Mode(TorchDispatchMode):
    def __init__(self, memory: LiveMemory):
        super().__init__()
        self.memory = memory

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo guard unless told not to; the replay
        # compiles nothing, and that guard was a fifth of its time (it runs at every op)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        memory = self.memory
        if any(issubclass(t, _DTensor) for t in types):
            return NotImplemented  # DTensor unwraps first; its local tensors come back here
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types) or _faking():
            # a fake tensor, or a factory call a FakeTensorMode below this mode will make fake: no bytes
            # in the real run either (DTensor's sharding propagation builds an op's inputs at their
            # global shapes under one, on a miss of its per-process cache only)
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return False if args[0].dtype == torch.bool else 0 if not args[0].is_floating_point() else 0.0
        if is_view(func):  # most ops the code runs: no new storage unless its input was never seen
            out = func(*args, **kwargs)
            self._charge_new(out, func, lambda: self._place_of(_metas(args, kwargs), kwargs))
            return out
        inputs = _tensors(args, kwargs)
        if _wants_cpu(kwargs) and not _empty_request(func, args):
            kwargs["device"] = torch.device("meta")
            place = memory.place if memory.place == UNPLACED or _inside_fsdp() else HOST
            where = lambda: place  # noqa: E731
        else:
            metas = [t for t in inputs if t.device.type == "meta"]
            if metas and any(t.device.type == "cpu" and t.dim() > 0 for t in inputs):
                args, kwargs = tree_map(_to_meta, (args, kwargs))
            # set_ swaps its input's storage: where the inputs were is read before it runs
            known = self._input_places(metas) if func.overloadpacket is _SET else None
            where = lambda: self._place_of(metas, kwargs, known)  # noqa: E731
        out = META_OUTPUTS.run(func, args, kwargs)
        self._charge_new(out, func, where)
        return out

    def _charge_new(self, out, func, where) -> None:
        """Charge each output whose storage is new; its place is worked out only then (most ops
        make none: views, in-place updates)."""
        memory, place = self.memory, None
        live = memory.live
        for t in _flat(out if isinstance(out, (list, tuple)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass: its inner tensors are counted
                continue
            if storage._cdata in live:
                continue
            if t.device.type != "meta":
                memory.charge(t, HOST, func.__name__, storage)
                continue
            place = place or where()
            memory.charge(t, place, func.__name__, storage)

    def _input_places(self, metas) -> set[str] | None:
        """The places of the inputs' storages, or None when they do not matter (forced or unplaced)."""
        memory = self.memory
        if memory.forced is not None or memory.place == UNPLACED:
            return None
        live = memory.live
        return {live[k].place for k in map(_key, metas) if k in live}

    def _place_of(self, metas, kwargs, known: set[str] | None = None) -> str:
        """The current role's place for what it asks onto its device; else where the inputs are."""
        memory = self.memory
        if memory.forced is not None:
            return memory.forced
        if memory.place == UNPLACED or kwargs.get("device") is not None:
            return memory.place
        places = known if known is not None else self._input_places(metas)
        if not places or places - {HOST, UNPLACED}:
            return memory.place
        return HOST if HOST in places else UNPLACED


_SET = torch.ops.aten.set_


def _metas(args, kwargs) -> list[torch.Tensor]:
    return [t for t in _tensors(args, kwargs) if t.device.type == "meta"]


def _flat(values):
    """The items of an op's arguments or outputs, one level of lists and tuples opened (no pytree:
    this runs at every op)."""
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [t for t in _flat((*args, *kwargs.values())) if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
