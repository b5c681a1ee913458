"""Cheap built-in rewards: a learnable signal for the tiny CPU model, no model needed."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from miles.rollout.rm_hub.colors import COLORS, find_color
from miles.rollout.rm_hub.types import RewardSample

_LUMA = np.array([0.2126, 0.7152, 0.0722], dtype=np.float32)  # Rec. 709


def luminance(sample: RewardSample) -> float:
    """Mean luminance of all pixels (all frames), in [0, 1]."""
    return float(sample.frames().mean(axis=(0, 2, 3)) @ _LUMA)


def target_color(sample: RewardSample) -> tuple[float, float, float]:
    name = sample.metadata.get("color") or find_color(sample.prompt)
    if name not in COLORS:
        raise ValueError(
            f"color_match needs a colour named in the prompt or in metadata['color'] "
            f"(one of {', '.join(COLORS)}); got {name!r}"
        )
    return COLORS[name]


def color_distance_score(sample: RewardSample) -> float:
    """1 - distance of the mean colour to the named colour, scaled to [0, 1]."""
    mean = sample.frames().mean(axis=(0, 2, 3))
    distance = float(np.linalg.norm(mean - np.asarray(target_color(sample), dtype=np.float32)))
    return 1.0 - distance / math.sqrt(3.0)


async def brightness(args: Any, samples: list[RewardSample]) -> list[float]:
    return [luminance(s) for s in samples]


async def color_match(args: Any, samples: list[RewardSample]) -> list[float]:
    return [color_distance_score(s) for s in samples]
