"""Several cases on one GPU: the device split into logical shares, packed by memory.

With `--gpu-shares K` every GPU counts as K shares of `device_gib / K` GiB each. A case that
states its peak GPU memory (`gpu_memory_gib` in the suite JSON) takes just enough shares to hold
it; one that does not takes whole devices, as without shares. The packer, the dispatch rule and
the Ray backend then work on shares exactly as they work on GPUs: cases whose memory fits
together run at the same time on the same device.

Why memory and not compute: the GPU check's cases (docs/ci.md) are far from filling an H200's
compute one at a time, but three of them at 139 GiB would not fit if one had been planned with
a whole device's memory in mind; memory is what makes sharing fail, so it is what is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from ci.cases import Case


@dataclass(frozen=True)
class ShareSpec:
    shares: int  # logical shares per GPU
    device_gib: float  # memory of one GPU

    def __post_init__(self) -> None:
        if self.shares < 1:
            raise ValueError(f"--gpu-shares must be at least 1, got {self.shares}")
        if self.device_gib <= 0:
            raise ValueError(f"--gpu-memory-gib must be positive, got {self.device_gib}")

    @property
    def share_gib(self) -> float:
        return self.device_gib / self.shares

    def shares_for(self, case: Case) -> int:
        """Shares the case takes: whole devices unless it states its memory; a case that
        states it runs on one GPU (a share never spans devices)."""
        if case.gpus == 0:
            return 0
        if case.gpu_memory_gib is None:
            return case.gpus * self.shares
        if case.gpus != 1 or case.nodes != 1:
            raise ValueError(f"{case.name}: gpu_memory_gib is for one-GPU cases, this one has "
                             f"{case.gpus} GPUs on {case.nodes} nodes")
        # a figure that is a whole number of shares must not round up by float noise
        needed = max(1, math.ceil(case.gpu_memory_gib / self.share_gib - 1e-9))
        if needed > self.shares:
            raise ValueError(f"{case.name}: needs {case.gpu_memory_gib:g} GiB, a GPU has "
                             f"{self.device_gib:g} GiB")
        return needed


def on_shares(cases: Sequence[Case], spec: ShareSpec) -> list[Case]:
    """The cases with `gpus` counted in shares (what the packer and the dispatchers count)."""
    return [replace(c, gpus=spec.shares_for(c)) for c in cases]


def share_labels(gpu_labels: Sequence[str], shares: int) -> list[str]:
    """The pool of shares: each GPU's label, once per share."""
    return [label for label in gpu_labels for _ in range(shares)]


def devices_of(labels: Sequence[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a set of pool entries: each device once, in order."""
    return ",".join(dict.fromkeys(labels))


def ray_gpu_request(shares: int, per_gpu: int) -> float | int:
    """Ray's num_gpus for `shares` shares: a fraction of one device, or whole devices (Ray
    takes nothing else)."""
    if shares % per_gpu == 0:
        return shares // per_gpu
    if shares > per_gpu:
        raise ValueError(f"{shares} shares of {per_gpu} per GPU span devices")
    return round(shares / per_gpu, 4)
