"""What a reward worker is sent of a sample: made by the engine that decoded it.

Rewards that read a few frames of a video as 8-bit pixels (`frame_to_pil`: PickScore, OCR) are
sent only those frames, already rounded to uint8 exactly as `frame_to_pil` rounds them, so their
scores are unchanged and a video crosses as a few frames x 1 byte instead of every frame x 4
bytes per value. Every other reward (the pixel statistics of `cheap`, a custom one) reads the
decoded values themselves and is sent every frame as decoded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from miles.rollout.rm_hub.registry import reward_name
from miles.rollout.rm_hub.types import RewardError, RewardSample, pick_frames
from miles.flags.reward_names import EIGHT_BIT_FRAMES

EVERY_FRAME = 0  # `frames_to_send`'s answer for a reward that reads the decoded values


def frames_to_send(args: Any, metadata: dict[str, Any]) -> int:
    """How many frames of a sample its reward reads as uint8, or EVERY_FRAME."""
    try:
        name = reward_name(args, metadata or {})
    except RewardError:  # the worker names the sample and the reason
        return EVERY_FRAME
    if name == "pickscore" and getattr(args, "pickscore_num_frames", None):
        return args.pickscore_num_frames  # the frames PickScore reads (rm_hub.pickscore.frames_scored)
    return EIGHT_BIT_FRAMES.get(name, EVERY_FRAME)


def reward_input(prompt: str, image: Any, metadata: dict[str, Any], frames: int) -> RewardSample:
    """The RewardSample a worker scores: `frames` uint8 frames, or (EVERY_FRAME) the pixels as they are."""
    sample = RewardSample(prompt, image, dict(metadata or {}))
    if frames == EVERY_FRAME:
        return sample.to_wire()
    pixels = np.round(pick_frames(sample.frames(), frames) * 255.0).astype(np.uint8)
    return RewardSample(prompt, pixels if sample.is_video else pixels[0], dict(sample.metadata))
