"""The train ranks' process group and every collective they run, the same code on CPU and GPU.

Why a mixed backend. A train step reduces two kinds of tensors: gradients, which live on the
rank's device (large, NCCL is what makes them fast on GPUs), and a handful of metric scalars,
which are Python floats that the step turns into a small float64 tensor on the CPU. NCCL only
takes CUDA tensors, so a plain "nccl" group fails on the first metric reduction; moving the
metrics to the GPU instead would cost a host->device copy and a device sync per step for a few
numbers and would leave the same trap for the next CPU tensor someone reduces. So a GPU rank's
group is `cpu:gloo,cuda:nccl`: torch.distributed dispatches each collective by its tensor's
device, CPU tensors over gloo and CUDA tensors over NCCL. A CPU rank's group is `gloo`. Both are
built by `init_process_group` below from the rank's device alone.

Every collective goes through `Collectives`, which refuses a tensor whose device the group's
backend cannot take, with a message naming both, before torch sees it. The check runs on every
device, and `supported_devices(backend_for("cuda"))` is what a CPU test asserts against to know
that the tensors it saw reduced would be accepted on a GPU rank too
(tests/unit/backends/test_collectives.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# the device types each torch.distributed backend takes tensors on
# (gloo has partial CUDA support in some builds; we never rely on it)
_BACKEND_DEVICES = {"gloo": frozenset({"cpu"}), "nccl": frozenset({"cuda"})}


def backend_for(device_type: str) -> str:
    """The process-group backend of a rank whose model lives on `device_type`."""
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"no process-group backend for device {device_type!r}; supported: cpu, cuda")


def supported_devices(backend: str) -> frozenset[str]:
    """Device types whose tensors a backend string (`gloo`, `nccl`, `cpu:gloo,cuda:nccl`) takes."""
    if ":" not in backend:
        return _BACKEND_DEVICES[backend]
    devices = set()
    for part in backend.split(","):
        device, name = part.split(":")
        if device not in _BACKEND_DEVICES[name]:
            raise ValueError(f"backend {name} cannot serve {device} tensors (in {backend!r})")
        devices.add(device)
    return frozenset(devices)


def host_store(host: str, timeout_s: float | None = None) -> dist.TCPStore:
    """A group's store, hosted by its first member on a port the OS assigns as it binds
    (`store.port`): a port found free and bound later can be taken in between by any other process
    (EADDRINUSE, seen under the parallel test suite). The others connect once they are told the port."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else dist.constants.default_pg_timeout
    return dist.TCPStore(host, 0, None, is_master=True, timeout=timeout, wait_for_workers=False)


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its backend does not serve."""


@dataclass
class Collectives:
    """The collectives of one rank: checked, and no-ops in a world of one."""

    device: torch.device
    world_size: int
    backend: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (op, backend, tensor device type)

    def __post_init__(self):
        self.backend = self.backend or backend_for(self.device.type)
        self.supported = supported_devices(self.backend)

    def init_process_group(self, rank: int, master_addr: str | None, master_port: int | None,
                           always: bool = False, store: dist.Store | None = None) -> None:
        """Join the group; a world of one has none unless `always` (FSDP2 needs a group even then).
        Rank 0 passes the store it hosts already (`host_store`) where it has one; the others
        connect to it at (master_addr, master_port). A process that already has the group (a second
        rank object in one test process) keeps it."""
        if not (self.world_size > 1 or always) or dist.is_initialized():
            return
        if store is None and self.world_size == 1:
            store = dist.HashStore()  # nobody to meet: no port at all
        elif store is None:
            if master_addr is None:
                raise ValueError(f"rank {rank} of {self.world_size} needs rank 0's address to join the process group")
            # a store object on every rank, as rank 0 may have one: a `tcp://` init method would put
            # its keys under a prefix that store does not use, and the ranks would never meet. Rank 0
            # without one (a test's processes, told a port) hosts it here.
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=rank == 0,
                                  timeout=dist.constants.default_pg_timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=self.world_size)

    def check(self, op: str, tensor: torch.Tensor) -> None:
        self.calls.append((op, self.backend, tensor.device.type))
        if tensor.device.type not in self.supported:
            raise CollectiveDeviceError(
                f"{op} of a {tensor.device.type} tensor on a {self.backend!r} process group, which serves "
                f"{sorted(self.supported)} tensors only; put the tensor on one of those devices")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place; `op` is sum or max."""
        self.check(f"all_reduce({op})", tensor)
        if self.world_size > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.check("broadcast", tensor)
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)
        return tensor

    def metric_tensor(self, values: list[float]) -> torch.Tensor:
        """Metric scalars to reduce: float64 on the CPU, served by gloo on either device."""
        return torch.tensor(values, dtype=torch.float64)
