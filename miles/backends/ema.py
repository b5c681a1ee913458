"""Exponential moving average of the trained parameters.

The shadow copy serves as a KL reference (`--diffusion-kl-reference ema`) and is checkpointed.
The same class keeps DiffusionNFT's old (sampling) policy under `--ema-rollout-policy ema`, updated once
per rollout with the ramped decay of `old_policy_decay`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class EMA:
    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.nn.Parameter], decay: float | None = None) -> None:
        """shadow <- decay * shadow + (1 - decay) * params (`decay`: this update's, else the fixed one)."""
        decay = self.decay if decay is None else decay
        for name, p in params.items():
            self.shadow[name].lerp_(p.detach(), 1.0 - decay)

    @contextmanager
    def swapped_in(self, params: dict[str, torch.nn.Parameter]) -> Iterator[None]:
        """Temporarily load the shadow weights into the live parameters."""
        backup = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(backup[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        for name in self.shadow:
            self.shadow[name].copy_(state[name])


def old_policy_decay(optimizer_step: int, *, init: float, ramp: float, maximum: float, flat_steps: int) -> float:
    """DiffusionNFT's `return_decay`: `init` for the first `flat_steps` optimizer steps, then
    min((step - flat_steps) * ramp, maximum)."""
    if optimizer_step < flat_steps:
        return init
    return min((optimizer_step - flat_steps) * ramp, maximum)
