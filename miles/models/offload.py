"""Offload: move a set of tensors' storage off the accelerator and back, byte for byte.

`--offload-train` and `--offload-rollout` let a train rank and a rollout engine that share a GPU
(`--colocate`) take turns: the idle side keeps its weights (and optimizer state) in host memory
while the other side runs. The move is done per storage, not per tensor: each distinct storage
is copied into a host buffer and then resized to zero bytes, which frees its memory while every
tensor, view, `nn.Parameter` and DTensor shard that points at it stays the same Python object
(optimizer state keyed by parameter, FSDP2's views into its padded shards, PEFT's wrappers all
keep working). `reload` resizes the storage back and copies the bytes in. On the CPU the "device"
and the host are the same memory, and the move is still real: the tensors' own storage is freed
and a separate copy holds the bytes (`resident_bytes` says what is left). The copies share one
host arena per offloaded part, kept between offloads (StorageOffload says why).
"""

from __future__ import annotations

from typing import Iterable

import torch


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (every byte, padding included)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter, gradient and buffer of the modules (DTensors by their local shard)."""
    out = []
    for module in modules:
        for p in module.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(module.buffers())
    return out


@torch.no_grad()
def own_storage(modules: Iterable[torch.nn.Module]) -> None:
    """Give parameters and buffers whose storage cannot be resized (a safetensors file mapping, as
    a CPU load leaves them) an ordinary allocation of their own, so `offload` can free it."""
    for module in modules:
        for sub in module.modules():
            for p in sub._parameters.values():
                if p is not None and not local(p.data).untyped_storage().resizable():
                    p.data = p.data.clone()
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.untyped_storage().resizable():
                    sub._buffers[name] = buf.clone()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class StorageOffload:
    """Host copies of tensors' storages; the device storages are freed while offloaded.

    The copies live in one host arena of exactly their total size, kept for the next offload
    (the same storages come back each time). For a GPU it is page-locked once with
    `cudaHostRegister`: torch's pinned-memory allocator (`pin_memory=True`) would round every
    storage's buffer up to a power of two and cache it, up to twice the bytes (a Wan2.2 A14B
    expert's 26.6 GiB of weights took 40.7 GiB of pinned memory). `layout` keeps each storage's
    size, so the plan can say what the rounding would have cost (`rounded_bytes`)."""

    def __init__(self, what: str):
        self.what = what
        # (storage, a uint8 tensor over all of it, its host copy); the uint8 tensor is kept so
        # that the reload writes through it instead of making it again (two ops less per storage)
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor, torch.Tensor]] = []
        self.arena: HostArena | None = None
        self.layout: list[int] = []  # bytes of each storage at the last offload

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> None:
        if self.offloaded:
            raise RuntimeError(f"{self.what} is already offloaded")
        storages = _distinct_storages(tensors)
        self.layout = [s.nbytes() for s in storages]
        if not storages:
            return
        arena = self._arena(sum(_aligned(n) for n in self.layout), any(s.device.type == "cuda" for s in storages))
        offset = 0
        for storage in storages:
            host = arena.buffer[offset:offset + storage.nbytes()]
            offset += _aligned(storage.nbytes())
            device_bytes = _storage_bytes(storage)
            host.copy_(device_bytes)
            storage.resize_(0)
            self._host.append((storage, device_bytes, host))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the memory back for the other process on this GPU

    def _arena(self, nbytes: int, pin: bool) -> "HostArena":
        if self.arena is None or self.arena.nbytes < nbytes:
            if self.arena is not None:
                self.arena.release()
            self.arena = HostArena(nbytes, pin)
        return self.arena

    @torch.no_grad()
    def reload(self) -> None:
        for storage, device_bytes, host in self._host:
            storage.resize_(host.numel())
            device_bytes.copy_(host)
        self._host = []

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() for _, _, host in self._host)

    @property
    def rounded_bytes(self) -> int:
        """What torch's pinned allocator would hold for the last offload: each storage's buffer rounded up
        to a power of two."""
        return sum(1 << (n - 1).bit_length() for n in self.layout if n)


ALIGNMENT = 512  # bytes: each storage's copy starts aligned for DMA


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: set[int] = set()
    out = []
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out.append(storage)
    return out


class HostArena:
    """One host buffer of exactly `nbytes`; `pin`: page-locked in place for copies from a GPU."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        self.pinned = False
        if pin:
            _check(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0), "cudaHostRegister")
            self.pinned = True

    def release(self) -> None:
        if self.pinned:
            _check(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()), "cudaHostUnregister")
            self.pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)


def _check(status, call: str) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"{call} of an offload arena failed (CUDA error {code})")


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors' distinct storages hold now (0 for an offloaded one)."""
    storages = {local(t.detach()).untyped_storage().data_ptr(): local(t.detach()).untyped_storage().nbytes()
                for t in tensors}
    return sum(storages.values())
