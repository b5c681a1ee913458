"""Rewards: `RewardSample`, `score_samples(args, samples)`, built-ins and the reward pool.

Importing this package loads neither torch nor Ray nor any model; the OCR and CLIP scorers and
the Ray pool are imported where they are used.
"""

from miles.rollout.rm_hub.registry import BUILTIN_REWARDS
from miles.rollout.rm_hub.scoring import score_samples
from miles.rollout.rm_hub.types import RewardError, RewardSample

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardSample", "score_samples"]
