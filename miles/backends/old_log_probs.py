"""--diffusion-recompute-old-log-prob: the PPO ratio's old log-probs from the train ranks' own
forward instead of the engines'.

Computed on the weights the rollout was sampled with, before the rollout's first optimizer step,
in the train micro-batches themselves (each one an engine microgroup at one step), so at the first
step the ratio is exactly 1 whatever the engines computed. With parity (the parity probe's 0.0)
they equal the engines' bit for bit; the flag is for runs where they do not.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def recompute_old_log_probs(rank, batch, schedule) -> dict:
    """Pair -> its log-prob under the current weights, for every pair this rank trains."""
    out = {}
    for micro in (mb for window in schedule for mb in window):
        step, _, _ = rank._forward(batch, micro, None)
        out.update(zip(micro, step.log_prob.detach()))
    return out


def old_log_probs(recomputed: dict | None, pairs, stored: torch.Tensor) -> torch.Tensor:
    """The old log-probs the loss uses: the recomputed ones when there are, else the engines'."""
    if recomputed is None:
        return stored
    return torch.stack([recomputed[p] for p in pairs]).to(stored.device)
