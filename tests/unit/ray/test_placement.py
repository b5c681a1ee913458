from types import SimpleNamespace

import pytest

from miles.ray.placement import REWARD_CPU_PER_WORKER, plan_placement


def flags(**kw):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=None, rollout_num_gpus_per_engine=1,
                colocate=False, device="cpu", rm_num_workers=1, rm_num_gpus_per_worker=0.0, colocate_reward=False,
                debug_rollout_only=False, train_only=False, loss_type="policy_loss")
    return SimpleNamespace(**{**base, **kw})


def test_cpu_job_fits_two_ranks_an_engine_and_a_reward_worker_on_two_cpus():
    plan = plan_placement(flags(), cpus_available=2.0)
    assert len(plan.train) == 2 and len(plan.rollout) == 1
    assert sum(b["CPU"] for b in plan.bundles) + REWARD_CPU_PER_WORKER <= 2.0
    assert plan.device == "cpu" and len({s.bundle_index for s in plan.train + plan.rollout}) == 3


def test_cpu_share_is_floored_so_the_bundles_fit():
    plan = plan_placement(flags(actor_num_gpus_per_node=1, rm_num_workers=2), cpus_available=1.0)
    assert sum(b["CPU"] for b in plan.bundles) + 2 * REWARD_CPU_PER_WORKER <= 1.0


def test_gpu_job_gives_train_ranks_and_engines_their_own_gpus():
    plan = plan_placement(flags(device="cuda", rollout_num_gpus=2, rm_num_gpus_per_worker=1.0))
    assert [b.get("GPU") for b in plan.bundles] == [1.0] * 4
    assert [s.bundle_index for s in plan.rollout] == [2, 3] and plan.reward == []


def test_gpu_colocate_puts_engines_and_colocated_rewards_in_the_train_bundles():
    plan = plan_placement(flags(device="cuda", colocate=True, rm_num_gpus_per_worker=0.1, colocate_reward=True))
    assert len(plan.bundles) == 2 and [s.bundle_index for s in plan.rollout] == [0, 1]
    assert plan.reward[0].bundle_index == plan.rollout[0].bundle_index
    for bundle in range(2):
        slots = [s for s in plan.train + plan.rollout + plan.reward if s.bundle_index == bundle]
        assert sum(s.num_gpus for s in slots) <= 1.0 + 1e-9
        assert sum(s.num_cpus for s in slots) <= plan.bundles[bundle]["CPU"]


def test_colocated_reward_that_leaves_no_engine_gpu_is_refused():
    with pytest.raises(ValueError, match="colocate-reward"):
        plan_placement(flags(device="cuda", colocate=True, rm_num_gpus_per_worker=0.5, colocate_reward=True))


def test_train_only_sft_and_rollout_only_drop_their_actors():
    assert plan_placement(flags(train_only=True), 2.0).rollout == []
    assert plan_placement(flags(loss_type="sft_loss"), 2.0).rollout == []
    assert plan_placement(flags(debug_rollout_only=True), 2.0).train == []


@pytest.mark.parametrize("n", [1, 3])
def test_engine_count_follows_rollout_gpus_one_gpu_per_engine(n):
    plan = plan_placement(flags(device="cuda", rollout_num_gpus=n))
    assert len(plan.rollout) == n and all(s.num_gpus == 1.0 for s in plan.rollout)


def test_multi_gpu_engines_are_refused_not_given_gpus_they_would_not_use():
    # --rollout-num-gpus-per-engine 2 used to reserve 2 GPUs per engine (and drop --colocate)
    with pytest.raises(ValueError, match="rollout-num-gpus-per-engine 2: an engine runs on one device; use 1"):
        plan_placement(flags(device="cuda", colocate=True, rollout_num_gpus=2, rollout_num_gpus_per_engine=2))


def test_colocate_shares_the_train_bundles_on_gpu_and_separates_them_without_it():
    shared = plan_placement(flags(device="cuda", colocate=True))
    own = plan_placement(flags(device="cuda", colocate=False, rollout_num_gpus=2))
    assert len(shared.bundles) == 2 and {s.bundle_index for s in shared.rollout} <= {s.bundle_index for s in shared.train}
    assert len(own.bundles) == 4 and not {s.bundle_index for s in own.rollout} & {s.bundle_index for s in own.train}
