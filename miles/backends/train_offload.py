"""`--offload-train`: a train rank's state lives in host memory except while the rank uses it.

Two parts move separately (miles.models.offload moves the bytes): the models (master weights,
the compute copy, gradients, buffers) and the optimizer side (AdamW state, the EMA shadow). A
train step and a checkpoint save or load need both; handing weights to the engines needs only the
models, so while a colocated engine receives its weights the rank holds its weights but not its
optimizer state. Outside those calls both are off the accelerator, so a colocated engine can
sample with the memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from miles.models.offload import StorageOffload, module_tensors, optimizer_tensors, own_storage


class TrainOffload:
    def __init__(self, rank):
        self.rank = rank
        self.models = StorageOffload(f"train rank {rank.rank} models")
        self.optimizer = StorageOffload(f"train rank {rank.rank} optimizer state")
        self.depth = 0  # resident() blocks open
        own_storage(self.modules())

    def modules(self) -> list[torch.nn.Module]:
        rank = self.rank
        return [m for model in {id(rank.model): rank.model, id(rank.fmodel): rank.fmodel}.values()
                for m in model.parts.values() if isinstance(m, torch.nn.Module)]

    def model_tensors(self) -> list[torch.Tensor]:
        return module_tensors(self.modules())

    def optimizer_tensors(self) -> list[torch.Tensor]:
        ema = list(self.rank.ema.shadow.values()) if self.rank.ema is not None else []
        return optimizer_tensors(self.rank.optimizer) + ema

    def offload(self) -> None:
        self.models.offload(self.model_tensors())
        self.optimizer.offload(self.optimizer_tensors())

    @property
    def offloaded(self) -> bool:
        return self.models.offloaded


@contextmanager
def resident(offload: TrainOffload | None, optimizer: bool) -> Iterator[None]:
    """The rank's models (and with `optimizer` its optimizer state) on the device for the block,
    off it again afterwards (an optimizer state the block created goes off too)."""
    if offload is None or offload.depth:  # nested: the outer block brought in what it needs
        yield
        return
    wanted = [(offload.models, offload.model_tensors)]
    if optimizer:
        wanted.append((offload.optimizer, offload.optimizer_tensors))
    for part, _ in wanted:
        if part.offloaded:
            part.reload()
    offload.depth += 1
    try:
        yield
    finally:
        offload.depth -= 1
        for part, tensors in wanted:
            if not part.offloaded:
                part.offload(tensors())
