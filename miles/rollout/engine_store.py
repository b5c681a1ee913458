"""What an engine keeps of the samples it made in a training run or an eval, and where.

A sample leaves the engine in three parts, each put in Ray's object store by the engine (so it
lies in the memory of the engine's node until nobody refers to it):
  - its `Trajectory.for_training` (none where nobody trains: an eval): the trained steps' latents, the model outputs
    the parity probe compares, no pixels, no conditioning;
  - its prompt group's conditioning, once per group: every sample of a prompt carries the same rows;
  - what its reward workers score (miles.rollout.rm_hub.wire: uint8 frames where they read 8 bits).
The driver gets a `StoredSample` per sample (references, and a thumbnail where it asked for one).
`put` is `ray.put` in an engine actor; anything that turns a value into a handle will do.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from miles.rollout.rm_hub.wire import reward_input
from miles.rollout.types import SampleRequest, StoredSample, Trajectory

THUMBNAIL_SIDE = 128  # pixels, the longer side of a progress-picture thumbnail


class SampleStore:
    """One `generate` call's store: the conditioning references of the groups it has put."""

    def __init__(self, put: Callable[[Any], Any], train: bool):
        self.put, self.train = put, train  # train: train ranks will read the trajectories
        self.conds: dict[int, tuple[str, Any]] = {}  # group -> (its prompt, the ref of its conditioning)

    def keep(self, requests: list[SampleRequest], trajectories: list[Trajectory]) -> list[StoredSample]:
        """One microgroup's samples, put away; its full trajectories can go once this returns."""
        return [self._keep_one(r, t) for r, t in zip(requests, trajectories)]

    def _keep_one(self, request: SampleRequest, trajectory: Trajectory) -> StoredSample:
        stored = StoredSample(
            request.group_index, request.sample_index,
            reward_input=self.put(reward_input(request.prompt, trajectory.image, request.metadata,
                                               request.reward_frames)),
            num_steps=trajectory.num_steps,
            thumbnail=thumbnail(trajectory.image) if request.thumbnail else None)
        if self.train:
            stored.trajectory = self.put(trajectory.for_training(request.output_steps))
            stored.cond = self._group_cond(request, trajectory)
        return stored

    def _group_cond(self, request: SampleRequest, trajectory: Trajectory) -> Any:
        prompt, ref = self.conds.get(request.group_index, (None, None))
        if ref is None:
            ref = self.put(trajectory.cond)
            self.conds[request.group_index] = (request.prompt, ref)
        elif prompt != request.prompt:
            raise ValueError(f"group {request.group_index} holds two prompts ({prompt!r}, {request.prompt!r}); "
                             f"a group is one prompt's samples")
        return ref


def thumbnail(image: torch.Tensor, side: int = THUMBNAIL_SIDE) -> np.ndarray:
    """A sample's first frame as uint8 [3, h, w], shrunk (area-averaged) until its longer side is at
    most `side` pixels."""
    frame = (image[0] if image.ndim == 4 else image).detach().to("cpu", torch.float32).clamp(0, 1)
    longer = max(frame.shape[-2:])
    if longer > side:
        size = [max(1, round(n * side / longer)) for n in frame.shape[-2:]]
        frame = torch.nn.functional.interpolate(frame[None], size=size, mode="area")[0]
    return (frame * 255.0).round().to(torch.uint8).numpy()
