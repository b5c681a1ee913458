"""Counting host syncs of device code on a CPU-only machine.

The code runs on `meta` tensors, which stand for device tensors (shapes, dtypes and ops, no data),
under a dispatch mode that counts every op which, on a GPU, would make the host wait for the
device: reading a value (`.item()`, `float()`, `.tolist()`: `_local_scalar_dense`) and copying a
device tensor to the CPU (`.cpu()`, `.to("cpu")`, a CPU tensor's `copy_` from one). Each is
answered (0, or an empty CPU tensor) so the code runs on and every sync is counted.
CPU tensors stay real: optimizer step counters live there on every device, and reading them is free.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DEVICE = "meta"  # what the counted code's tensors are made on


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


class HostSyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _on_device(args[0]):
            self.syncs.append("read of a device value")
            return 0.0 if args[0].is_floating_point() else 0
        if func is aten._to_copy.default and _on_device(args[0]) and self._to_cpu(kwargs):
            self.syncs.append("copy of a device tensor to the host")
            return torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device="cpu")
        if func is aten.copy_.default and args[0].device.type == "cpu" and _on_device(args[1]):
            self.syncs.append("copy of a device tensor into a host tensor")
            return args[0]
        return func(*args, **kwargs)

    @staticmethod
    def _to_cpu(kwargs) -> bool:
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"
