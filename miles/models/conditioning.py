"""A transformer's prompt conditioning: built by a model's text encoders, carried by trajectories.

It lives with the models (who make and consume it) so that the rollout and the trainer above can
both depend on it; `miles.rollout.types` re-exports it for what crosses the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Conditioning:
    """The transformer's prompt conditioning, batch-first.

    `positive` holds the keyword tensors the family's transformer takes for the prompt
    (e.g. `encoder_hidden_states`, `pooled_projections`); `negative` the same for the negative
    prompt, or None for unguided families. A trajectory stores its sample's slice (batch 1), so the
    trainer recomputes velocity without any text encoder.
    """

    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return next(iter(self.positive.values())).shape[0]

    def select(self, index: int) -> "Conditioning":
        """Sample `index` as a batch of one (a copy: a pickled view would carry the whole batch)."""
        pick = lambda d: None if d is None else {k: t[index : index + 1].clone() for k, t in d.items()}  # noqa: E731
        return Conditioning(pick(self.positive), pick(self.negative))

    @staticmethod
    def cat(items: list["Conditioning"]) -> "Conditioning":
        join = lambda ds: {k: torch.cat([d[k] for d in ds]) for k in ds[0]}  # noqa: E731
        negatives = [c.negative for c in items]
        if any(n is None for n in negatives) and not all(n is None for n in negatives):
            raise ValueError("cannot join guided and unguided conditioning")
        return Conditioning(
            join([c.positive for c in items]),
            None if negatives[0] is None else join(negatives),
        )

    def to(self, device=None, dtype: torch.dtype | None = None) -> "Conditioning":
        def move(d):
            if d is None:
                return None
            return {k: t.to(device=device, dtype=dtype if t.is_floating_point() and dtype else t.dtype) for k, t in d.items()}

        return Conditioning(move(self.positive), move(self.negative))
