"""Small modules for the weight-sync tests: plain torch, so spawned processes start fast.

`LoraLike` names its adapter tensors as PEFT does (`<layer>.lora_A.default.weight`), which is all
the LoRA filter of a weight update looks at.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, lora_rank: int = 0):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        if lora_rank:
            self.lora_A = nn.ModuleDict({"default": nn.Linear(width, lora_rank, bias=False)})
            self.lora_B = nn.ModuleDict({"default": nn.Linear(lora_rank, width, bias=False)})


class LoraLike(nn.Module):
    """Blocks of mixed sizes: a big embedding, small norms, a scalar-ish gate."""

    def __init__(self, width: int = 16, blocks: int = 3, lora_rank: int = 0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(Block(width, lora_rank) for _ in range(blocks))
        self.gate = nn.Parameter(torch.randn(1))


def perturbed(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter moved by noise, so a sync that copied nothing would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * 0.1)
    return module


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8),
                                                                                  b[k].view(-1).view(torch.uint8))
                                        for k in a)
