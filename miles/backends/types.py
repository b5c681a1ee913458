"""What crosses between the driver and the train ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.rollout.types import Trajectory
from miles.flags.batching import Pair


@dataclass
class RolloutBatch:
    """One rollout, scored, as a train rank reads it: samples prompt-major (index = group *
    n_samples_per_prompt + sample); a rank's shard holds None for the samples it does not train.
    Samples of one prompt share their conditioning tensors."""

    rollout_id: int
    trajectories: list[Trajectory | None]
    rewards: list[float]
    advantages: list[float]
    trained_steps: list[int]


@dataclass
class RolloutRefs:
    """One rollout, scored, as the driver hands it to the train ranks: where each sample's
    trajectory and its group's conditioning lie in Ray's object store (the engine that made it put
    them there: miles.rollout.engine_store), and the rewards and advantages. A rank's shard has None
    for the samples it does not train; it fetches the rest itself (miles.backends.rollout_shard)."""

    rollout_id: int
    trajectories: list[Any]  # per sample: ObjectRef of its Trajectory, or None
    conds: list[Any]  # per sample: ObjectRef of its prompt group's Conditioning, or None
    rewards: list[float]
    advantages: list[float]
    trained_steps: list[int]


@dataclass
class TrainResult:
    """One rank's report for one rollout. Metrics are already reduced over all ranks."""

    rank: int
    metrics: dict[str, float]
    shard: list[Pair] = field(default_factory=list)  # the pairs this rank trained, in order
