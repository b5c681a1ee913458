"""Each train rank receives only the trajectories its pairs read.

A rollout's trajectories (latents of every step, conditioning, stored model outputs) are most of
its bytes; a rank trains only the pairs the batch plan deals it (`miles.utils.batching`), so the
driver puts one batch per rank in which every other trajectory is None. Indices stay global:
pair `sample` i is still `trajectories[i]`, so the rank's code reads its shard as it read the
whole batch. Rewards and advantages (a float per sample) travel whole.
"""

from __future__ import annotations

import dataclasses

from miles.backends.types import RolloutBatch
from miles.utils.batching import expand_pairs, shard_pairs


def samples_of_rank(plan, trained_steps: list[int], rank: int) -> set[int]:
    """The samples whose trajectories DP rank `rank` reads this rollout."""
    pairs = shard_pairs(expand_pairs(plan.samples_per_rollout, trained_steps), plan.dp_size, rank, plan.dp_split_mode)
    return {p.sample for p in pairs}


def rank_shard(batch: RolloutBatch, plan, rank: int) -> RolloutBatch:
    """The batch as rank `rank` needs it: its trajectories in place, None for the others."""
    keep = samples_of_rank(plan, batch.trained_steps, rank)
    trajectories = [t if i in keep else None for i, t in enumerate(batch.trajectories)]
    return dataclasses.replace(batch, trajectories=trajectories)
