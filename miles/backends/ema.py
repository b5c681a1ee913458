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
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @torch.no_grad()
    def update(self, params: dict[str, torch.nn.Parameter], decay: float | None = None) -> None:
        """shadow <- decay * shadow + (1 - decay) * params (`decay`: this update's, else the fixed one)."""
        decay = self.decay if decay is None else decay
        for name, p in params.items():
            self.shadow[name].lerp_(p.detach(), 1.0 - decay)

    @contextmanager
    def swapped_in(self, params: dict[str, torch.nn.Parameter]) -> Iterator[None]:
        """Temporarily load the shadow weights into the live parameters: the two exchange contents
        in place (the shadow holds the live weights meanwhile), so a swap allocates no copy of the
        model, only a scratch tensor of the largest one, kept for the next swap."""
        self._exchange(params)
        try:
            yield
        finally:
            self._exchange(params)

    @torch.no_grad()
    def _exchange(self, params: dict[str, torch.nn.Parameter]) -> None:
        for name, p in params.items():
            live, kept = _local(p.detach()), _local(self.shadow[name])
            scratch = self._scratch_for(live)
            scratch.copy_(live)
            live.copy_(kept)
            kept.copy_(scratch)

    def _scratch_for(self, t: torch.Tensor) -> torch.Tensor:
        scratch = self._scratch.get((t.dtype, t.device))
        if scratch is None or scratch.numel() < t.numel():
            scratch = self._scratch[t.dtype, t.device] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        return scratch[:t.numel()].view(t.shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        for name in self.shadow:
            self.shadow[name].copy_(state[name])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's own shard (a view: writing it writes the parameter), or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def old_policy_decay(optimizer_step: int, *, init: float, ramp: float, maximum: float, flat_steps: int) -> float:
    """DiffusionNFT's `return_decay`: `init` for the first `flat_steps` optimizer steps, then
    min((step - flat_steps) * ramp, maximum)."""
    if optimizer_step < flat_steps:
        return init
    return min((optimizer_step - flat_steps) * ramp, maximum)
