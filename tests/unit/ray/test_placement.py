from types import SimpleNamespace

import pytest

from miles.ray.placement import plan_placement


def flags(**kw):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=None, rollout_num_gpus_per_engine=1,
                colocate=False, device="cpu", rm_num_workers=1, rm_num_gpus_per_worker=0.0, colocate_reward=False,
                debug_rollout_only=False, train_only=False, loss_type="policy_loss")
    return SimpleNamespace(**{**base, **kw})


def test_cpu_job_fits_two_ranks_an_engine_and_a_reward_worker_on_two_cpus():
    plan = plan_placement(flags(), cpus_available=2.0)
    assert len(plan.train) == 2 and len(plan.rollout) == 1 and len(plan.reward) == 1
    assert sum(b["CPU"] for b in plan.bundles) <= 2.0
    assert plan.device == "cpu" and {s.num_cpus for s in plan.train} == {0.5}
    assert len({s.bundle_index for s in plan.train + plan.rollout + plan.reward}) == 4


def test_cpu_share_is_floored_so_the_bundles_fit():
    plan = plan_placement(flags(actor_num_gpus_per_node=1, rm_num_workers=1), cpus_available=2.0 / 3 * 3)
    assert sum(b["CPU"] for b in plan.bundles) <= 2.0


def test_gpu_job_separate_engine_and_reward_gpus():
    plan = plan_placement(flags(device="cuda", rollout_num_gpus=2, rm_num_gpus_per_worker=1.0))
    assert [b.get("GPU") for b in plan.bundles] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert [s.bundle_index for s in plan.rollout] == [2, 3] and plan.reward[0].bundle_index == 4


def test_gpu_colocate_puts_engines_in_the_train_bundles():
    plan = plan_placement(flags(device="cuda", colocate=True, rm_num_gpus_per_worker=0.1, colocate_reward=True))
    assert len(plan.bundles) == 2 and [s.bundle_index for s in plan.rollout] == [0, 1]
    for bundle in range(2):
        used = sum(s.num_gpus for s in plan.train + plan.rollout + plan.reward if s.bundle_index == bundle)
        assert used <= 1.0
    assert plan.reward[0].bundle_index == plan.rollout[0].bundle_index


def test_train_only_and_sft_start_no_engines():
    assert plan_placement(flags(train_only=True), 2.0).rollout == []
    assert plan_placement(flags(loss_type="sft_loss"), 2.0).rollout == []
    assert plan_placement(flags(debug_rollout_only=True), 2.0).train == []


@pytest.mark.parametrize("n", [1, 3])
def test_engine_count_follows_rollout_gpus_per_engine(n):
    plan = plan_placement(flags(device="cuda", rollout_num_gpus=2 * n, rollout_num_gpus_per_engine=2))
    assert len(plan.rollout) == n and all(s.num_gpus == 2.0 for s in plan.rollout)
