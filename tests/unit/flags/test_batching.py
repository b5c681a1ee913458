"""The torch-free pair functions the validator and the trainer share."""

from __future__ import annotations

import pytest

from miles.flags.batching import (
    BatchLayoutError, BatchPlan, MicroBatchSpec, Pair, expand_pairs, micro_batches, rank_schedule,
    shard_pairs, split_steps, window_grid,
)


def test_expand_pairs_is_sample_major_over_the_trained_steps():
    assert expand_pairs(2, [3, 5]) == [(0, 3), (0, 5), (1, 3), (1, 5)]
    assert expand_pairs(2, [3])[1] == Pair(sample=1, step=3)


def test_contiguous_split_gives_each_rank_one_block():
    pairs = expand_pairs(4, [0, 1])
    assert shard_pairs(pairs, 2, 0, "contiguous") == pairs[:4]
    assert shard_pairs(pairs, 2, 1, "contiguous") == pairs[4:]


def test_stride_split_deals_round_robin():
    pairs = expand_pairs(4, [0, 1])
    assert shard_pairs(pairs, 2, 0, "stride") == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert shard_pairs(pairs, 2, 1, "stride") == [(0, 1), (1, 1), (2, 1), (3, 1)]


def test_shard_refuses_pairs_that_do_not_deal_evenly():
    with pytest.raises(BatchLayoutError, match="do not deal evenly"):
        shard_pairs(expand_pairs(3, [0]), 2, 0, "contiguous")


def test_shard_refuses_a_rank_outside_dp_and_an_unknown_mode():
    with pytest.raises(BatchLayoutError):
        shard_pairs(expand_pairs(2, [0]), 2, 2, "contiguous")
    with pytest.raises(BatchLayoutError, match="unknown dp split mode"):
        shard_pairs(expand_pairs(2, [0]), 2, 0, "diagonal")


def test_split_steps_cuts_equal_consecutive_windows():
    shard = expand_pairs(3, [0, 1])
    assert split_steps(shard, 3) == [shard[0:2], shard[2:4], shard[4:6]]


def test_split_steps_raises_the_shard_rule_message():
    with pytest.raises(BatchLayoutError, match=r"^num_pairs_shard=6 not divisible by num_steps_per_rollout=4$"):
        split_steps(expand_pairs(3, [0, 1]), 4)


def test_flat_micro_batches_are_consecutive_chunks():
    window = expand_pairs(3, [0, 1])
    assert micro_batches(window, MicroBatchSpec(size=2)) == [window[0:2], window[2:4], window[4:6]]


def test_flat_micro_batch_that_does_not_divide_the_window_is_refused():
    with pytest.raises(BatchLayoutError, match="not divisible by micro_batch_size=4"):
        micro_batches(expand_pairs(3, [0, 1]), MicroBatchSpec(size=4))


def test_2d_tiles_visit_samples_first_in_sample_major_order():
    window = expand_pairs(4, [0, 1])
    tiles = micro_batches(window, MicroBatchSpec(tile_samples=2, tile_steps=1, iter_order="sample-major"))
    assert tiles == [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0), (3, 0)], [(2, 1), (3, 1)]]


def test_2d_tiles_visit_timesteps_first_in_timestep_major_order():
    window = expand_pairs(4, [0, 1])
    tiles = micro_batches(window, MicroBatchSpec(tile_samples=2, tile_steps=1, iter_order="timestep-major"))
    assert tiles == [[(0, 0), (1, 0)], [(2, 0), (3, 0)], [(0, 1), (1, 1)], [(2, 1), (3, 1)]]


def test_2d_tile_holds_samples_by_timesteps():
    tiles = micro_batches(expand_pairs(2, [4, 7]), MicroBatchSpec(tile_samples=2, tile_steps=2))
    assert tiles == [[(0, 4), (0, 7), (1, 4), (1, 7)]]


def test_2d_tile_that_does_not_divide_the_grid_is_refused():
    with pytest.raises(BatchLayoutError, match="does not tile into 3 x 1"):
        micro_batches(expand_pairs(4, [0]), MicroBatchSpec(tile_samples=3, tile_steps=1))


def test_window_that_is_not_a_full_grid_cannot_be_tiled_in_2d():
    with pytest.raises(BatchLayoutError, match="not a full samples x timesteps grid"):
        window_grid([Pair(0, 0), Pair(1, 1)])


def _plan(**overrides) -> BatchPlan:
    fields = dict(
        family="sd3", rollout_batch_size=2, n_samples_per_prompt=2, samples_per_rollout=4,
        global_batch_size=2, num_steps_per_rollout=2, num_denoising_steps=4, num_trained_steps=2,
        train_pairs=8, dp_size=2, dp_split_mode="contiguous", pairs_per_rank=4,
        pairs_per_step_per_rank=2, micro_batching=MicroBatchSpec(size=1), forwards_per_step=2,
        step_strategy="sde_window", trainable_steps=(0, 1),
    )
    return BatchPlan(**{**fields, **overrides})


@pytest.mark.parametrize("mode", ["contiguous", "stride"])
def test_rank_schedules_train_every_pair_exactly_once(mode):
    plan = _plan(dp_split_mode=mode)
    trained = [
        pair
        for rank in range(plan.dp_size)
        for step in rank_schedule(plan, [1, 3], rank)
        for forward in step
        for pair in forward
    ]
    assert sorted(trained) == sorted(expand_pairs(4, [1, 3]))
    assert len(trained) == len(set(trained))


def test_rank_schedule_shape_matches_the_plan_counts():
    plan = _plan()
    schedule = rank_schedule(plan, [0, 2], 1)
    assert len(schedule) == plan.num_steps_per_rollout
    assert all(len(step) == plan.forwards_per_step for step in schedule)
    assert all(len(forward) == plan.pairs_per_forward for step in schedule for forward in step)


def test_rank_schedule_refuses_a_step_choice_of_the_wrong_size():
    with pytest.raises(BatchLayoutError, match="chose 3 steps but the plan trains 2"):
        rank_schedule(_plan(), [0, 1, 2], 0)


def test_plan_table_shows_every_count():
    table = _plan().table()
    for label, value in [("samples per rollout", "4"), ("train pairs", "8"), ("dp size", "2"),
                         ("pairs per rank", "4"), ("pairs per optimizer step per rank", "2"),
                         ("pairs per forward", "1"), ("forwards per optimizer step", "2")]:
        assert any(line.split(label, 1)[-1].split()[0] == value
                   for line in table.splitlines() if line.strip().startswith(label)), label


def test_plan_table_names_the_expert_of_each_trainable_step_when_there_are_two():
    plan = _plan(trainable_steps=(0, 3), sigmas=(1.0, 0.9, 0.5, 0.2), experts=(
        "transformer", "transformer", "transformer_2", "transformer_2"))
    table = plan.table()
    assert "step 0 (sigma 1.0000)" in table and "step 3 (sigma 0.2000)" in table
    assert table.count("trains transformer_2") == 1
    assert plan.expert_for_step(2) == "transformer_2"


def test_plan_without_experts_names_none():
    assert "sigma" not in _plan().table()
    assert _plan().expert_for_step(0) is None


def test_plan_is_frozen_and_serialises_with_pairs_per_forward():
    plan = _plan()
    with pytest.raises(AttributeError):
        plan.dp_size = 3  # type: ignore[misc]
    assert plan.as_dict()["pairs_per_forward"] == 1
