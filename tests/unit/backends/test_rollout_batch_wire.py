"""A RolloutBatch pickles column by column (miles/backends/types.py) and comes back equal: every
trajectory, None slots of a rank's shard, fields that cannot be stacked, unguided conditioning."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from miles.backends.types import RolloutBatch
from miles.rollout.types import Conditioning, Trajectory


def _cond(seed: int, guided: bool = True) -> Conditioning:
    g = torch.Generator().manual_seed(seed)
    side = lambda: {"encoder_hidden_states": torch.randn(1, 6, 4, generator=g),  # noqa: E731
                    "pooled_projections": torch.randn(1, 4, generator=g)}
    return Conditioning(side(), side() if guided else None)


def _trajectory(i: int, steps: int = 3, guided: bool = True, outputs: bool = True) -> Trajectory:
    g = torch.Generator().manual_seed(1000 + i)
    return Trajectory(
        prompt=f"prompt {i // 2}", group_index=i // 2, sample_index=i % 2, seed=i,
        latents=torch.randn(steps + 1, 4, 2, 2, generator=g), sigmas=torch.linspace(1, 0, steps + 1),
        log_probs=torch.randn(steps, generator=g), trained_steps=[0, 1], cond=_cond(i, guided),
        experts=["transformer"] * steps, guidance_scales=[4.0] * steps, sde_type="sde", noise_level=0.7,
        image=torch.empty(0), model_outputs=torch.randn(steps, 4, 2, 2, generator=g) if outputs else None,
        metadata={"i": i}, reward=0.1 * i)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Conditioning):
        return _equal(a.positive, b.positive) and _equal(a.negative, b.negative)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _same_batch(a: RolloutBatch, b: RolloutBatch) -> bool:
    if (a.rollout_id, a.rewards, a.advantages, a.trained_steps) != (b.rollout_id, b.rewards, b.advantages,
                                                                    b.trained_steps):
        return False
    if len(a.trajectories) != len(b.trajectories):
        return False
    for x, y in zip(a.trajectories, b.trajectories):
        if (x is None) != (y is None):
            return False
        if x is not None and not all(_equal(getattr(x, f.name), getattr(y, f.name))
                                     for f in dataclasses.fields(Trajectory)):
            return False
    return True


def _batch(trajectories) -> RolloutBatch:
    n = len(trajectories)
    return RolloutBatch(3, trajectories, [0.5] * n, [0.25 * i for i in range(n)], [0, 1])


def test_a_batch_comes_back_equal_with_each_tensor_field_stacked_once():
    batch = _batch([_trajectory(i) for i in range(6)])
    blob = pickle.dumps(batch)
    assert _same_batch(pickle.loads(blob), batch)
    # one stacked tensor per field instead of one per sample: far fewer pickled tensor records
    per_sample = sum(len(pickle.dumps(t.latents)) for t in batch.trajectories)
    assert len(blob) < 0.9 * (per_sample + sum(len(pickle.dumps(t.cond)) + len(pickle.dumps(t.model_outputs))
                                               for t in batch.trajectories))


def test_a_rank_shard_keeps_its_none_slots():
    batch = _batch([_trajectory(i) if i % 3 else None for i in range(6)])
    back = pickle.loads(pickle.dumps(batch))
    assert [t is None for t in back.trajectories] == [t is None for t in batch.trajectories]
    assert _same_batch(back, batch)
    assert _same_batch(pickle.loads(pickle.dumps(_batch([None, None]))), _batch([None, None]))


def test_fields_that_differ_in_shape_or_presence_travel_as_they_are():
    mixed = [_trajectory(0), _trajectory(1, steps=4), _trajectory(2, outputs=False), _trajectory(3, guided=False)]
    batch = _batch(mixed)
    assert _same_batch(pickle.loads(pickle.dumps(batch)), batch)


def test_unguided_conditioning_is_stacked_and_stays_unguided():
    batch = _batch([_trajectory(i, guided=False) for i in range(4)])
    back = pickle.loads(pickle.dumps(batch))
    assert all(t.cond.negative is None for t in back.trajectories)
    assert _same_batch(back, batch)


def test_equal_conditioning_rows_travel_once():
    def batch(shared: bool) -> RolloutBatch:
        trajectories = [_trajectory(i) for i in range(8)]
        for i, t in enumerate(trajectories):  # shared: four samples a prompt, one negative prompt for all
            t.cond = _cond(i // 4 if shared else i)
            if shared:
                t.cond.negative = {k: v.clone() for k, v in _cond(99).negative.items()}
        return _batch(trajectories)

    shared, distinct = batch(True), batch(False)
    back = pickle.loads(pickle.dumps(shared))
    assert _same_batch(back, shared) and _same_batch(pickle.loads(pickle.dumps(distinct)), distinct)
    cond_bytes = lambda b: len(pickle.dumps(b)) - len(pickle.dumps(_batch([  # noqa: E731
        dataclasses.replace(t, cond=_cond(0)) for t in b.trajectories])))
    # 2 positive rows and 1 negative instead of 8 and 8 (within the pickle's bookkeeping)
    assert cond_bytes(shared) < 0.4 * cond_bytes(distinct)
