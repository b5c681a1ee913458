"""What crosses between the driver and the train ranks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.rollout.types import Conditioning, Trajectory
from miles.utils.batching import Pair


@dataclass
class RolloutBatch:
    """One rollout, scored: samples prompt-major (index = group * n_samples_per_prompt + sample).

    Pickled (a Ray put, a rank's shard) column by column (`pack_trajectories`): each tensor field
    of the trajectories travels as one stacked tensor instead of one small tensor per sample,
    which costs a fraction of the time to serialise and to load, and equal conditioning rows (a
    prompt's samples, the negative prompt) travel once. The trajectories a rank unpickles hold
    views into those stacked tensors; samples with equal conditioning share its tensors.
    """

    rollout_id: int
    trajectories: list[Trajectory | None]
    rewards: list[float]
    advantages: list[float]
    trained_steps: list[int]

    def __reduce__(self):
        return _unpack_batch, (self.rollout_id, pack_trajectories(self.trajectories), self.rewards, self.advantages,
                               self.trained_steps)


@dataclass
class TrainResult:
    """One rank's report for one rollout. Metrics are already reduced over all ranks."""

    rank: int
    metrics: dict[str, float]
    shard: list[Pair] = field(default_factory=list)  # the pairs this rank trained, in order


# -- the batch on the wire ---------------------------------------------------------------------

@dataclass
class _Column:
    """One field over the present trajectories: stacked (a tensor of equal shapes), conditioning
    (one stacked column per key), or the values as they are."""

    kind: str  # "stacked", "cond" or "values"
    data: Any


def pack_trajectories(trajectories: list[Trajectory | None]) -> dict:
    present = [t for t in trajectories if t is not None]
    slots = [t is not None for t in trajectories]
    if not present:
        return {"slots": slots, "columns": {}}
    columns = {f.name: _pack_column([getattr(t, f.name) for t in present]) for f in dataclasses.fields(Trajectory)}
    return {"slots": slots, "columns": columns}


def unpack_trajectories(packed: dict) -> list[Trajectory | None]:
    columns = {name: _unpack_column(column) for name, column in packed["columns"].items()}
    present = iter([Trajectory(**{name: values[i] for name, values in columns.items()})
                    for i in range(sum(packed["slots"]))])
    return [next(present) if slot else None for slot in packed["slots"]]


def _unpack_batch(rollout_id: int, packed: dict, rewards: list[float], advantages: list[float],
                  trained_steps: list[int]) -> RolloutBatch:
    return RolloutBatch(rollout_id, unpack_trajectories(packed), rewards, advantages, trained_steps)


def _stackable(values: list) -> bool:
    first = values[0]
    return (isinstance(first, torch.Tensor)
            and all(isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
                    and v.device == first.device for v in values))


def _pack_column(values: list) -> _Column:
    if _stackable(values):
        return _Column("stacked", torch.stack(values))
    if all(isinstance(v, Conditioning) for v in values) and _cond_stackable(values):
        negatives = None if values[0].negative is None else _pack_dicts([v.negative for v in values])
        return _Column("cond", (_pack_dicts([v.positive for v in values]), negatives))
    return _Column("values", values)


def _cond_stackable(values: list[Conditioning]) -> bool:
    """Every sample's conditioning has the same keys and shapes (guided or not, all alike)."""
    def alike(dicts):
        return (all(d.keys() == dicts[0].keys() for d in dicts)
                and all(_stackable([d[k] for d in dicts]) for k in dicts[0]))

    if any((v.negative is None) != (values[0].negative is None) for v in values):
        return False
    return alike([v.positive for v in values]) and (values[0].negative is None or alike([v.negative for v in values]))


def _pack_dicts(dicts: list[dict[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """Per key: the distinct rows stacked, and which one each sample has. Samples of one prompt
    carry equal prompt embeddings and every sample the same negative ones, so a rollout's
    conditioning shrinks to a row per prompt (at full scale, megabytes a sample)."""
    return {k: _distinct_rows([d[k] for d in dicts]) for k in dicts[0]}


def _distinct_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    distinct: list[torch.Tensor] = []
    by_key: dict[tuple, list[int]] = {}  # a cheap fingerprint; rows are compared whole within one
    index = []
    for row in rows:
        flat = row.reshape(-1)
        key = (float(flat[:: max(1, flat.numel() // 64)].double().sum()), float(flat[-1]) if flat.numel() else 0.0)
        same = next((j for j in by_key.get(key, []) if torch.equal(distinct[j], row)), None)
        if same is None:
            same = len(distinct)
            distinct.append(row)
            by_key.setdefault(key, []).append(same)
        index.append(same)
    return torch.stack(distinct), index


def _unpack_column(column: _Column) -> list:
    if column.kind == "stacked":
        return list(column.data.unbind(0))
    if column.kind == "cond":
        positive, negative = column.data
        count = len(next(iter(positive.values()))[1])
        pick = lambda d, i: None if d is None else {k: rows[index[i]] for k, (rows, index) in d.items()}  # noqa: E731
        return [Conditioning(pick(positive, i), pick(negative, i)) for i in range(count)]
    return column.data
