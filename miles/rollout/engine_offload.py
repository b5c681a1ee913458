"""`--offload-rollout`: an engine's pipeline weights live in host memory while it does not sample.

After each `generate` and each weight update the engine's weights go off the accelerator
(miles.models.offload moves the bytes), so a colocated train rank can train and save with the
memory; they come back when the engine next needs them: a weight load, a LoRA injection or a generate.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from miles.models.offload import StorageOffload, module_tensors, own_storage


class EngineOffload:
    def __init__(self, model):
        self.model = model
        self.weights = StorageOffload("rollout engine weights")
        own_storage(self.modules())

    def modules(self) -> list[torch.nn.Module]:
        return [m for m in self.model.parts.values() if isinstance(m, torch.nn.Module)]

    def tensors(self) -> list[torch.Tensor]:
        return module_tensors(self.modules())


def reload_weights(offload: EngineOffload | None) -> None:
    if offload is not None and offload.weights.offloaded:
        offload.weights.reload()


@contextmanager
def resident_while_sampling(offload: EngineOffload | None) -> Iterator[None]:
    reload_weights(offload)
    try:
        yield
    finally:
        if offload is not None:
            offload.weights.offload(offload.tensors())
