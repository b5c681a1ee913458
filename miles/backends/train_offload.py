"""`--offload-train`: a train rank's state lives in host memory except while the rank uses it.

Three parts move separately (miles.models.offload moves the bytes): the synced weights (what a
weight update reads: the trained tensors, or only the LoRA adapters), the rest of the models
(master weights, the compute copy, gradients, buffers, parts not trained) and the optimizer side
(AdamW state, the EMA shadow). A train step and a checkpoint save or load need all three; handing
weights to the engines needs only the synced weights, so while a colocated engine receives its
weights the rank holds no more than those. Outside those calls all three are off the accelerator,
so a colocated engine can sample with the memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from miles.models.offload import StorageOffload, module_tensors, optimizer_tensors, own_storage


class TrainOffload:
    def __init__(self, rank):
        self.rank = rank
        # offloaded and reloaded in this order; a storage belongs to the first part that lists it
        self.synced = StorageOffload(f"train rank {rank.rank} synced weights")
        self.models = StorageOffload(f"train rank {rank.rank} models")
        self.optimizer = StorageOffload(f"train rank {rank.rank} optimizer state")
        self.depth = 0  # resident() blocks open
        own_storage(self.modules())

    def modules(self) -> list[torch.nn.Module]:
        rank = self.rank
        return [m for model in {id(rank.model): rank.model, id(rank.fmodel): rank.fmodel}.values()
                for m in model.parts.values() if isinstance(m, torch.nn.Module)]

    def synced_tensors(self) -> list[torch.Tensor]:
        """All a rank needs back to hand its weights to the engines."""
        return [t for _, _, t in self.rank.synced_tensors()]

    def model_tensors(self) -> list[torch.Tensor]:
        return module_tensors(self.modules())

    def optimizer_tensors(self) -> list[torch.Tensor]:
        ema = list(self.rank.ema.shadow.values()) if self.rank.ema is not None else []
        return optimizer_tensors(self.rank.optimizer) + ema

    def parts(self):
        return [(self.synced, self.synced_tensors), (self.models, self.model_tensors),
                (self.optimizer, self.optimizer_tensors)]

    def offload(self) -> None:
        for part, tensors in self.parts():
            if not part.offloaded:
                part.offload(tensors())

    @property
    def offloaded(self) -> bool:
        return self.models.offloaded


@contextmanager
def resident(offload: TrainOffload | None, optimizer: bool, synced_only: bool = False) -> Iterator[None]:
    """For the block: the rank's models (`synced_only`: only the tensors a weight update reads) and,
    with `optimizer`, its optimizer state on the device. When the outermost block ends, everything
    goes off again (an optimizer state the block created too)."""
    if offload is None:
        yield
        return
    wanted = [offload.synced] + ([] if synced_only else [offload.models]) + ([offload.optimizer] if optimizer else [])
    for part in wanted:  # a nested block may want more than the one around it brought
        if part.offloaded:
            part.reload()
    offload.depth += 1
    try:
        yield
    finally:
        offload.depth -= 1
        if offload.depth == 0:
            offload.offload()
