"""Each train rank receives only its shard of a rollout, and trains on it exactly as on the whole."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from dtype_helpers import engine_for, one_rollout, tiny_args
from miles.backends.rollout_shard import rank_shard, samples_of_rank
from miles.utils.batching import rank_schedule

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


def test_each_rank_is_sent_about_half_the_bytes_and_every_trajectory_it_reads(tmp_path):
    args, plan = _two_rank_args(tmp_path)
    batch = one_rollout(args, 0, engine_for(args))
    whole = len(pickle.dumps(batch))
    shards = [rank_shard(batch, plan, rank) for rank in range(RANKS)]
    sent = [len(pickle.dumps(s)) for s in shards]
    print(f"rollout of {len(batch.trajectories)} samples: whole {whole} B, per rank {sent} B")
    # the trajectories are nearly all of the bytes; rewards, advantages and the None slots are not.
    # Equal conditioning rows travel once per message (miles/backends/types.py): the negative
    # prompt's, which every rank needs, once per rank
    negative = sum(t.numel() * t.element_size() for t in batch.trajectories[0].cond.negative.values())
    assert all(b < 0.6 * whole for b in sent)
    assert sum(b for b in sent) < 1.1 * whole + (RANKS - 1) * negative
    for rank, shard in enumerate(shards):
        read = {p.sample for window in rank_schedule(plan, batch.trained_steps, rank) for mb in window for p in mb}
        assert read == samples_of_rank(plan, batch.trained_steps, rank)
        assert all((shard.trajectories[i] is not None) == (i in read) for i in range(len(batch.trajectories)))
        assert shard.rewards == batch.rewards and shard.advantages == batch.advantages


def test_a_rank_trains_on_its_shard_bit_for_bit_as_on_the_whole_batch(tmp_path, rank_one_of_two):
    from miles.backends.actor import TrainRank

    args, plan = _two_rank_args(tmp_path)
    batch = one_rollout(args, 0, engine_for(args))
    results = []
    for given in (batch, rank_shard(batch, plan, 1)):
        rank = TrainRank(args, plan, 1, RANKS)
        rank.setup()
        metrics = rank.train(given).metrics
        results.append(({k: v for k, v in metrics.items() if not k.startswith("perf/")}, rank.trained_state()))
    (whole_metrics, whole_state), (shard_metrics, shard_state) = results
    assert "train/loss" in whole_metrics and shard_metrics == whole_metrics
    assert all(torch.equal(shard_state[k], whole_state[k]) for k in whole_state)
