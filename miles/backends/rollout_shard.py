"""Each train rank receives only the trajectories its pairs read, and what the engines keep for it.

A rollout's trajectories are most of its bytes; a rank trains only the pairs the batch plan deals
it (`miles.flags.batching`), so the driver hands each rank a batch in which every other sample is
None. Indices stay global: pair `sample` i is still `trajectories[i]`, so the rank's code reads its
shard as it read the whole batch. Rewards and advantages (a float per sample) travel whole. In a
run the shard holds references (`RolloutRefs`): the rank fetches its trajectories from where the
engines left them (`fetch_shard`), never through the driver.

The engines keep a sample's model outputs only at the steps the parity probe compares
(`probed_outputs`: the same micro-batches `TrainRank` probes, over every rank).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

from miles.backends.types import RolloutBatch, RolloutRefs
from miles.flags.batching import expand_pairs, rank_schedule, shard_pairs

Batch = TypeVar("Batch", RolloutBatch, RolloutRefs)


def samples_of_rank(plan, trained_steps: list[int], rank: int) -> set[int]:
    """The samples whose trajectories DP rank `rank` reads this rollout."""
    pairs = shard_pairs(expand_pairs(plan.samples_per_rollout, trained_steps), plan.dp_size, rank, plan.dp_split_mode)
    return {p.sample for p in pairs}


def rank_shard(batch: Batch, plan, rank: int) -> Batch:
    """The batch as rank `rank` needs it: its samples in place, None for the others."""
    keep = samples_of_rank(plan, batch.trained_steps, rank)
    mine = lambda values: [v if i in keep else None for i, v in enumerate(values)]  # noqa: E731
    if isinstance(batch, RolloutRefs):
        return dataclasses.replace(batch, trajectories=mine(batch.trajectories), conds=mine(batch.conds))
    return dataclasses.replace(batch, trajectories=mine(batch.trajectories))


def fetch_shard(refs: RolloutRefs, get: Callable[[list[Any]], list[Any]]) -> RolloutBatch:
    """The rank's trajectories fetched from where they lie (`get` is `ray.get`), each prompt
    group's conditioning once and shared by its samples."""
    present = [i for i, ref in enumerate(refs.trajectories) if ref is not None]
    trajectories = get([refs.trajectories[i] for i in present])
    groups = list(dict.fromkeys(refs.conds[i] for i in present))
    conds = dict(zip(groups, get(groups))) if groups else {}
    out: list = [None] * len(refs.trajectories)
    for i, trajectory in zip(present, trajectories):
        trajectory.cond = conds[refs.conds[i]]
        out[i] = trajectory
    return RolloutBatch(refs.rollout_id, out, refs.rewards, refs.advantages, refs.trained_steps)


def probed_outputs(args, plan, trained_steps: list[int]) -> dict[int, tuple[int, ...]]:
    """sample -> the steps whose engine model outputs the parity probe compares this rollout (on
    any rank); {} without --diffusion-debug-mode. Every other model output is never read."""
    from miles.backends.parity_probe import probe_limit, probed_micro_batches

    if not args.diffusion_debug_mode:
        return {}
    limit, nft = probe_limit(args), args.loss_type == "nft"
    wanted: dict[int, set[int]] = {}
    for rank in range(plan.dp_size):
        for micro in probed_micro_batches(rank_schedule(plan, trained_steps, rank), limit, nft):
            for pair in micro:
                wanted.setdefault(pair.sample, set()).add(pair.step)
    return {sample: tuple(sorted(steps)) for sample, steps in wanted.items()}
