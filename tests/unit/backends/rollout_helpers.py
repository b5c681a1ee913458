"""A scored rollout as a train rank receives it in a run, for tests that drive a rank in process."""

from __future__ import annotations

import dataclasses

from miles.backends.rollout_shard import probed_outputs
from miles.backends.types import RolloutBatch


def as_a_rank_gets_it(args, plan, batch: RolloutBatch) -> RolloutBatch:
    """Each trajectory as the engine keeps it (`Trajectory.for_training`: the trained steps' latents,
    the model outputs the probe compares), its group's conditioning shared as a fetched shard has it."""
    outputs = probed_outputs(args, plan, batch.trained_steps)
    conds = {}
    kept = []
    for i, t in enumerate(batch.trajectories):
        cond = conds.setdefault(t.group_index, t.cond)
        kept.append(dataclasses.replace(t.for_training(outputs.get(i, ())), cond=cond))
    return dataclasses.replace(batch, trajectories=kept)
