"""Each train rank receives only its shard of a rollout, fetches it from where it lies, and trains on it
exactly as on the whole."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from dtype_helpers import engine_for, one_rollout, tiny_args
from rollout_helpers import as_a_rank_gets_it
from miles.backends.rollout_shard import fetch_shard, rank_shard, samples_of_rank
from miles.backends.types import RolloutRefs
from miles.flags.batching import rank_schedule

RANKS = 2


@pytest.fixture
def rank_one_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=RANKS)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _two_rank_args(run_dir):
    # a rank's optimizer step holds one sample (at 2 steps): the engines sample one at a time to match
    return tiny_args(run_dir, f"--actor-num-gpus-per-node {RANKS} --num-gpus-per-node {RANKS + 1} "
                              f"--rollout-microgroup-size 1")


def test_each_rank_is_handed_only_the_samples_it_reads_and_fetches_each_groups_conditioning_once(tmp_path):
    args, plan = _two_rank_args(tmp_path)
    batch = as_a_rank_gets_it(args, plan, one_rollout(args, 0, engine_for(args)))
    # the object store, as a dict: a reference is a key; each get is recorded
    store = {("t", i): t for i, t in enumerate(batch.trajectories)}
    store.update({("c", t.group_index): t.cond for t in batch.trajectories})
    refs = RolloutRefs(0, [("t", i) for i in range(len(batch.trajectories))], [("c", t.group_index) for t in batch.trajectories],
                       batch.rewards, batch.advantages, batch.trained_steps)
    for rank in range(RANKS):
        fetched = []
        get = lambda keys: fetched.extend(keys) or [pickle.loads(pickle.dumps(store[k])) for k in keys]  # noqa: E731
        shard = fetch_shard(rank_shard(refs, plan, rank), get)
        read = {p.sample for window in rank_schedule(plan, batch.trained_steps, rank) for mb in window for p in mb}
        assert read == samples_of_rank(plan, batch.trained_steps, rank)
        assert all((shard.trajectories[i] is not None) == (i in read) for i in range(len(batch.trajectories)))
        assert {k for k in fetched if k[0] == "t"} == {("t", i) for i in read}
        groups = {batch.trajectories[i].group_index for i in read}
        assert sorted(k for k in fetched if k[0] == "c") == sorted(("c", g) for g in groups)  # once a group
        present = [t for t in shard.trajectories if t is not None]
        assert all(t.cond is next(u for u in present if u.group_index == t.group_index).cond for t in present)
        assert shard.rewards == batch.rewards and shard.advantages == batch.advantages


def test_a_rank_trains_on_its_fetched_shard_bit_for_bit_as_on_the_whole_sampled_batch(tmp_path, rank_one_of_two):
    """The whole batch as the engine sampled it (every step's latents and model outputs) against the
    rank's shard as a run hands it over: trimmed to its trained steps, the probed outputs, the
    conditioning once a group."""
    from miles.backends.actor import TrainRank

    args, plan = _two_rank_args(tmp_path)
    batch = one_rollout(args, 0, engine_for(args))
    results = []
    for given in (batch, rank_shard(as_a_rank_gets_it(args, plan, batch), plan, 1)):
        rank = TrainRank(args, plan, 1, RANKS)
        rank.setup()
        metrics = rank.train(given).metrics
        results.append(({k: v for k, v in metrics.items() if not k.startswith("perf/")}, rank.trained_state()))
    (whole_metrics, whole_state), (shard_metrics, shard_state) = results
    assert "train/loss" in whole_metrics and shard_metrics == whole_metrics
    assert whole_metrics["train/model_output_max_abs_diff"] == 0.0
    assert all(torch.equal(shard_state[k], whole_state[k]) for k in whole_state)
