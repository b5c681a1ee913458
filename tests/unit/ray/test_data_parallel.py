"""Two CPU train ranks against one on the same global batch, and the shard each rank trains."""

from __future__ import annotations

import pytest
import torch

from miles.backends.actor import TrainRank
from miles.models.runtime import CPU_THREADS_PER_ACTOR
from miles.backends.loss import compute_advantages
from miles.backends.types import RolloutBatch
from miles.ray.placement import PlacementPlan, Slot
from miles.ray.rollout_manager import sample_seed
from miles.rollout.data import PromptDataset
from miles.rollout.engine import RolloutEngine
from miles.rollout.rm_hub.pool import LocalRewardScorer
from miles.rollout.rm_hub.types import RewardSample
from miles.rollout.types import SampleRequest
from miles.flags.arguments import parse_and_plan
from miles.flags.batching import expand_pairs, shard_pairs
from tests.tools.adam_bound import check_first_adamw_step


def one_rollout(args):
    engine = RolloutEngine.from_args(args, num_threads=CPU_THREADS_PER_ACTOR)
    items = PromptDataset.from_args(args).next_batch(args.rollout_batch_size)
    requests = [SampleRequest(it.prompt, g, j, sample_seed(args.rollout_seed, 0, g, j), dict(it.metadata))
                for g, it in enumerate(items) for j in range(args.n_samples_per_prompt)]
    steps = [0, 1]
    trajectories = engine.generate(requests, steps, True)
    rewards = LocalRewardScorer(args).score([RewardSample(t.prompt, t.image, t.metadata) for t in trajectories])
    advantages = compute_advantages(torch.tensor(rewards), args.n_samples_per_prompt)
    return RolloutBatch(0, trajectories, rewards, advantages.tolist(), steps)


COMMON = "--num-rollout 1 --colocate --clip-grad 0"


@pytest.fixture(scope="module")
def one_rank(tiny_argv, tmp_path_factory):
    """One rollout and the one-rank step on it: the reference of both split modes. One rank trains
    every pair in the same order under either mode (shard_pairs(pairs, 1, 0, mode) == pairs), so
    the reference is the same for both and is made once."""
    run_dir = tmp_path_factory.mktemp("one_rank")
    args1, plan1 = parse_and_plan(tiny_argv(run_dir, f"{COMMON} --actor-num-gpus-per-node 1 --num-gpus-per-node 1"))
    pairs = expand_pairs(plan1.samples_per_rollout, [0, 1])
    assert all(shard_pairs(pairs, 1, 0, mode) == pairs for mode in ("contiguous", "stride"))
    batch = one_rollout(args1)
    single = TrainRank(args1, plan1, 0, 1)
    single.setup()
    before = single.trained_state()
    single_metrics = single.train(batch).metrics
    return args1, batch, before, single_metrics, single.trained_state()


# two Ray train ranks against one, in both splits of the batch: nightly (`slow`); the README's command
# proves sharded and replicated ranks equal one rank in process (backends/test_fsdp.py), and every CPU
# recipe case trains two Ray ranks at parity 0.0
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["contiguous", "stride"])
def test_two_ranks_match_one_rank_and_each_trains_its_own_shard(ray_cluster, tiny_argv, tmp_path, mode, one_rank):
    import ray

    from miles.ray.train_actor_group import TrainActorGroup

    args1, batch, before, single_metrics, expected = one_rank
    common = f"--train-dp-split-mode {mode} {COMMON}"
    args2, plan2 = parse_and_plan(tiny_argv(tmp_path, f"{common} --actor-num-gpus-per-node 2 --num-gpus-per-node 2"))

    placement = PlacementPlan([{"CPU": 0.5}, {"CPU": 0.5}], [Slot(0, 0.5, 0.0), Slot(1, 0.5, 0.0)])
    from miles.ray.placement import create_placement_group

    pg = create_placement_group(placement)
    group = TrainActorGroup(args2, plan2, placement, pg).wait_ready()
    try:
        results = group.train(batch)
        rank_states = [group.trained_state(r) for r in range(2)]
    finally:
        group.shutdown()
        ray.util.remove_placement_group(pg)

    pairs = expand_pairs(plan2.samples_per_rollout, batch.trained_steps)
    shards = [r.shard for r in results]
    assert shards == [shard_pairs(pairs, 2, r, mode) for r in range(2)]
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == sorted(pairs)
    if mode == "contiguous":  # sample-major blocks: rank 0 holds the first half of the samples
        assert {p.sample for p in shards[0]} == set(range(plan2.samples_per_rollout // 2))

    # after the gradient all-reduce both ranks hold the very same weights
    for name in expected:
        assert torch.equal(rank_states[0][name], rank_states[1][name]), name
    assert any(not torch.equal(before[n], expected[n]) for n in expected), "the step must move the weights"
    # one AdamW step on a gradient summed in another order (an all-reduce of two halves): bounded by
    # what that step can produce, not by a number read off one machine (tests/tools/adam_bound.py)
    check_first_adamw_step(rank_states[0], expected, before, args1.lr)
    # each pair's loss is -A r (or -A clip(r)), r = exp(log_prob - recorded log_prob): the two runs'
    # losses differ by at most |A| |r_a - r_b| <= |A| (d_a + d_b) e^d, d the log-prob diff each run
    # reports against the engine, plus fp32 rounding of -A r on each side (the metric sums in float64)
    d = [results[0].metrics["train/log_prob_abs_diff"], single_metrics["train/log_prob_abs_diff"]]
    mean_abs_adv = sum(abs(a) for a in batch.advantages) / len(batch.advantages)
    bound = mean_abs_adv * (sum(d) * 1.01 + 4 * 2.0 ** -24 * (1 + args1.diffusion_clip_range)) + 1e-12
    assert abs(results[0].metrics["train/loss"] - single_metrics["train/loss"]) <= bound
    # the same gradient up to rounding: | |g_a| - |g_b| | <= |g_a - g_b|, rounding of terms of size up
    # to 1e3 |g| (cancellation in backward) at fp32's 6e-8 per operation times a few hundred
    # operations per element stays below 1e-3 |g|; another gradient (another shard) differs by O(1)
    assert results[0].metrics["train/grad_norm"] == pytest.approx(single_metrics["train/grad_norm"], rel=1e-3)
