
import numpy as np
import pytest

from miles.rollout.rm_hub import RewardError, RewardSample
from miles.ray.reward_pool import RewardPool
from miles.rollout.rm_hub.pool import LocalRewardScorer, split_evenly


def test_split_evenly_covers_all_samples_in_order():
    assert split_evenly(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_evenly(2, 4) == [(0, 1), (1, 2)]
    assert split_evenly(0, 2) == []


@pytest.fixture
def ray_session(local_ray):
    return local_ray


def _samples():
    rng = np.random.default_rng(0)
    colors = ["red", "blue", "green", "yellow", "cyan"]
    return [RewardSample(f"a {colors[i % 5]} ball", rng.random((3, 8, 8)).astype(np.float32),
                         {"rm_type": "brightness"} if i % 3 == 0 else {}) for i in range(11)]


def test_pool_matches_local_scorer_in_order_and_names_global_sample_on_error(ray_session, make_args):
    args = make_args(rm_type="color_match", rm_num_workers=3, rm_num_gpus_per_worker=0.0)
    pool = RewardPool(args)
    try:
        samples = _samples()
        assert pool.score(samples) == LocalRewardScorer(args).score(samples)
        broken = samples[:9] + [RewardSample("a ball", samples[9].image)]
        with pytest.raises(RewardError, match=r"'color_match'.*sample 9 \(prompt 'a ball'\)"):
            pool.score(broken)
    finally:
        pool.shutdown()


def test_workers_ask_for_a_quarter_cpu_and_the_configured_gpu_share(make_args):
    from miles.ray.reward_pool import _actor_options

    assert _actor_options(make_args(rm_num_gpus_per_worker=0.0), None, None, None) == {"num_cpus": 0.25, "num_gpus": 0.0}
    assert _actor_options(make_args(rm_num_gpus_per_worker=0.5), None, None, {"env_vars": {"A": "1"}}) == {
        "num_cpus": 0.25, "num_gpus": 0.5, "runtime_env": {"env_vars": {"A": "1"}}}


def test_workers_of_a_cpu_job_ask_for_no_gpu_whatever_the_gpu_share(make_args):
    from miles.ray.reward_pool import _actor_options

    options = _actor_options(make_args(rm_num_gpus_per_worker=1.0, device="cpu"), None, None, None)
    assert options["num_gpus"] == 0.0
