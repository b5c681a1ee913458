"""What crosses between the driver and the train ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.rollout.types import Trajectory
from miles.utils.batching import Pair


@dataclass
class RolloutBatch:
    """One rollout, scored: samples prompt-major (index = group * n_samples_per_prompt + sample)."""

    rollout_id: int
    trajectories: list[Trajectory]
    rewards: list[float]
    advantages: list[float]
    trained_steps: list[int]


@dataclass
class TrainResult:
    """One rank's report for one rollout. Metrics are already reduced over all ranks."""

    rank: int
    metrics: dict[str, float]
    shard: list[Pair] = field(default_factory=list)  # the pairs this rank trained, in order
