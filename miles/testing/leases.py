"""GPU leases: which GPUs a test may use, held so that nothing else takes them meanwhile.

The pool is the GPUs NVML reports, narrowed to `CUDA_VISIBLE_DEVICES` when that is set. A GPU
is *free* when it runs no compute process and has little memory in use. Each leased GPU is
held through an exclusive `flock` on `<lock_dir>/gpu-<uuid>.lock` (via `filelock`): other
pytest-xdist workers and other pytest processes on the machine take the same locks, and the
kernel drops them when the holder dies, so a crashed test never strands a GPU.

A *shared* lease (`--miles-gpu-shared`) is for a test the CI runner placed on a share of a GPU
(ci/run_suite.py --gpu-shares): other tests run on the same device by design, so it takes the
pool's first GPUs as they are, neither waiting for them to be idle nor locking them.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from filelock import FileLock, Timeout

DEFAULT_LOCK_DIR = Path(os.environ.get("MILES_GPU_LOCK_DIR", "/tmp/miles-gpu-locks"))
DEFAULT_MAX_USED_MIB = 1024.0


class NoNvml(RuntimeError):
    """NVML cannot be used here (no driver, no library, no GPUs)."""


class NotEnoughGpus(RuntimeError):
    def __init__(self, needed: int, free: int, detail: str = ""):
        self.needed, self.free = needed, free
        msg = f"needs {needed} GPU{'s' if needed != 1 else ''}, found {free} free"
        super().__init__(msg + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it. `ident` is how it is named to CUDA (the pool entry)."""

    ident: str
    index: int
    uuid: str
    name: str = ""
    memory_used_mib: float = 0.0
    memory_total_mib: float = 0.0
    compute_pids: tuple[int, ...] = ()

    def busy_reason(self, max_used_mib: float) -> str | None:
        if self.compute_pids:
            return f"GPU {self.ident} runs compute processes {list(self.compute_pids)}"
        if self.memory_used_mib > max_used_mib:
            return f"GPU {self.ident} has {self.memory_used_mib:.0f} MiB in use"
        return None


def visible_pool(env: dict | None = None) -> list[str] | None:
    """`CUDA_VISIBLE_DEVICES` as a list of entries, or None when it is unset."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip() and d.strip() != "-1"]


def probe_gpus(pool: Sequence[str] | None = None) -> list[GpuInfo]:
    """Read the GPUs with NVML. Raises NoNvml when NVML is not usable."""
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NoNvml(f"pynvml is not installed ({e})") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NoNvml(f"NVML is not available: {e}") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
        entries = list(pool) if pool is not None else [str(i) for i in range(count)]
        gpus = []
        for entry in entries:
            if re.fullmatch(r"\d+", entry):
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                pids = tuple(int(p.pid) for p in procs)
            except pynvml.NVMLError:
                pids = ()
            gpus.append(GpuInfo(entry, pynvml.nvmlDeviceGetIndex(handle), uuid, name,
                                mem.used / 2**20, mem.total / 2**20, pids))
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


@dataclass
class GpuLease:
    """GPUs held for one test. `devices` is the `--cuda-visible-devices` value."""

    gpus: list[GpuInfo]
    locks: list[FileLock] = field(default_factory=list, repr=False)

    @property
    def devices(self) -> str:
        return ",".join(g.ident for g in self.gpus)

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def __len__(self) -> int:
        return len(self.gpus)

    def release(self) -> None:
        while self.locks:
            lock = self.locks.pop()
            try:
                lock.release(force=True)
            except Exception:
                pass

    def __enter__(self) -> "GpuLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path(lock_dir: Path, gpu: GpuInfo) -> Path:
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", gpu.uuid or f"index{gpu.index}")
    return Path(lock_dir) / f"gpu-{key}.lock"


def try_lease(
    needed: int,
    gpus: Sequence[GpuInfo],
    *,
    lock_dir: Path = DEFAULT_LOCK_DIR,
    max_used_mib: float = DEFAULT_MAX_USED_MIB,
    shared: bool = False,
) -> GpuLease:
    """One attempt: lock `needed` free GPUs of `gpus` without waiting (shared: take the first
    `needed` as they are, unlocked).

    Raises NotEnoughGpus naming how many were needed and how many were free.
    """
    if shared:
        if len(gpus) < needed:
            raise NotEnoughGpus(needed, len(gpus), f"the shared pool has only {len(gpus)}")
        return GpuLease(list(gpus[:needed]))
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(lock_dir, 0o1777)  # shared by every user's tests, like /tmp
    except OSError:
        pass
    busy = [r for r in (g.busy_reason(max_used_mib) for g in gpus) if r]
    candidates = [g for g in gpus if g.busy_reason(max_used_mib) is None]
    held: list[FileLock] = []
    taken: list[GpuInfo] = []
    leased_elsewhere = 0
    for gpu in candidates:
        if len(taken) == needed:
            break
        lock = FileLock(str(lock_path(lock_dir, gpu)), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            leased_elsewhere += 1
            continue
        held.append(lock)
        taken.append(gpu)
    if len(taken) < needed:
        for lock in held:
            lock.release(force=True)
        details = []
        if leased_elsewhere:
            details.append(f"{leased_elsewhere} leased by other tests")
        details += busy
        free = len(candidates) - leased_elsewhere
        raise NotEnoughGpus(needed, free, "; ".join(details) or f"pool of {len(gpus)}")
    return GpuLease(taken, held)


def lease_gpus(
    needed: int,
    *,
    lock_dir: Path = DEFAULT_LOCK_DIR,
    max_used_mib: float = DEFAULT_MAX_USED_MIB,
    wait: float = 0.0,
    poll: float = 5.0,
    probe: Callable[[Sequence[str] | None], list[GpuInfo]] = probe_gpus,
    pool: Sequence[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    shared: bool = False,
) -> GpuLease:
    """Lease `needed` GPUs, waiting up to `wait` seconds while enough exist but others hold them.

    Raises NoNvml without NVML, NotEnoughGpus when the pool is too small or stays taken.
    """
    if pool is None:
        pool = visible_pool()
    deadline = clock() + wait
    while True:
        gpus = probe(pool)
        if len(gpus) < needed:
            raise NotEnoughGpus(needed, len(gpus), f"the pool has only {len(gpus)}")
        try:
            return try_lease(needed, gpus, lock_dir=lock_dir, max_used_mib=max_used_mib, shared=shared)
        except NotEnoughGpus:
            if clock() >= deadline:
                raise
        sleep(poll)
