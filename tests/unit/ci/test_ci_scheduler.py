"""The packer: valid plans, close to the lower bound, and a checker that catches bad plans."""

import itertools
import random
import statistics

import pytest

from ci.scheduler import (Dispatcher, Job, lower_bound, make_plan, plan_problems, simulate,
                          wide_job_bound)

NODE = list(range(8))
GPU_COUNTS = [1, 2, 4, 5, 8]
# a nightly suite has more small tests than node-sized ones
NIGHTLY_WEIGHTS = [35, 25, 20, 10, 10]


def synthetic_suite(seed, weights=None, size=40):
    rng = random.Random(seed)
    return [Job(f"case{i}", rng.choices(GPU_COUNTS, weights)[0], rng.randint(60, 1800))
            for i in range(size)]


def checked_ratio(jobs, bound):
    plan = make_plan(jobs, NODE, seed=0)
    problems = plan_problems(plan.as_json(), jobs, NODE)
    assert not problems, problems
    return plan.makespan / bound(jobs)


def test_nightly_like_suites_pack_within_3_percent_on_average_and_10_percent_always():
    ratios = [checked_ratio(synthetic_suite(seed, NIGHTLY_WEIGHTS), lambda j: lower_bound(j, 8))
              for seed in range(25)]
    assert statistics.mean(ratios) <= 1.03, ratios
    assert max(ratios) <= 1.10, ratios


def test_uniform_gpu_counts_pack_close_to_the_best_possible_makespan():
    # with as many 5- and 8-GPU tests as 1-GPU ones, wide tests queue behind each other and the
    # simple bound is out of reach; the wide-job bound is what no plan can beat
    ratios = [checked_ratio(synthetic_suite(1000 + seed), lambda j: wide_job_bound(j, 8))
              for seed in range(25)]
    assert statistics.mean(ratios) <= 1.03, ratios
    assert max(ratios) <= 1.10, ratios


def test_simple_bound_is_out_of_reach_when_wide_tests_dominate():
    jobs = [Job(f"w{i}", 5, 1000) for i in range(4)] + [Job("n", 4, 1000)]
    assert lower_bound(jobs, 8) == 3000
    assert wide_job_bound(jobs, 8) == 4500
    assert make_plan(jobs, NODE).makespan == 5000


def brute_force_best(jobs, pool):
    return min(max(s.end for s in simulate(order, pool, 1))
               for order in itertools.permutations(jobs))


@pytest.mark.parametrize("seed", range(6))
def test_wide_job_bound_never_exceeds_an_achievable_makespan(seed):
    jobs = synthetic_suite(seed, size=6)
    assert wide_job_bound(jobs, 8) <= brute_force_best(jobs, NODE) + 1e-9


def test_lower_bound_is_area_over_gpus_or_longest_test():
    assert lower_bound([Job("a", 8, 100), Job("b", 4, 100)], 8) == 150
    assert lower_bound([Job("a", 1, 500), Job("b", 1, 10)], 8) == 500


def test_checker_reports_overlap_wrong_count_repeat_and_missing():
    jobs = [Job("a", 2, 10), Job("b", 2, 10), Job("c", 1, 10)]
    plan = [
        {"name": "a", "gpus": [0, 1], "start": 0, "end": 10},
        {"name": "b", "gpus": [1, 2, 3], "start": 5, "end": 15},
        {"name": "a", "gpus": [4, 5], "start": 20, "end": 30},
    ]
    problems = "\n".join(plan_problems(plan, jobs, NODE))
    assert "a and b share GPUs [1]" in problems
    assert "b: got GPUs [1, 2, 3], needs 2" in problems
    assert "a: scheduled 2 times" in problems
    assert "c: never scheduled" in problems


def test_checker_accepts_back_to_back_use_of_a_gpu():
    jobs = [Job("a", 8, 10), Job("b", 8, 10)]
    plan = [{"name": "a", "gpus": NODE, "start": 0, "end": 10},
            {"name": "b", "gpus": NODE, "start": 10, "end": 20}]
    assert plan_problems(plan, jobs, NODE) == []


def test_tests_of_different_gpu_counts_share_the_node_at_once():
    jobs = [Job("five", 5, 100), Job("two", 2, 100), Job("one", 1, 100)]
    plan = make_plan(jobs, NODE)
    assert plan.makespan == 100
    assert sorted(g for s in plan.slots for g in s.gpus) == NODE


def test_cpu_cases_never_exceed_their_slots():
    jobs = [Job(f"cpu{i}", 0, 10) for i in range(5)]
    plan = make_plan(jobs, NODE, cpu_slots=2)
    for t in range(0, 40):
        assert sum(s.start <= t < s.end for s in plan.slots) <= 2
    assert plan.makespan == 30


def test_too_wide_tests_are_left_out_of_the_plan():
    plan = make_plan([Job("huge", 16, 10), Job("ok", 8, 10)], NODE)
    assert [j.name for j in plan.unschedulable] == ["huge"]
    assert [s.name for s in plan.slots] == ["ok"]


def test_dispatcher_starts_the_next_case_as_soon_as_gpus_free():
    dispatcher = Dispatcher([Job("a", 6, 1000), Job("b", 4, 1)], NODE, cpu_slots=1)
    assert [j.name for j, _ in dispatcher.start_ready()] == ["a"]
    assert dispatcher.start_ready() == []
    dispatcher.release("a")
    (job, gpus), = dispatcher.start_ready()
    assert job.name == "b" and len(gpus) == 4


def test_search_scoring_agrees_with_the_dispatcher_the_runner_uses():
    from ci.scheduler import _score

    rng = random.Random(7)
    jobs = synthetic_suite(3) + [Job(f"cpu{i}", 0, rng.randint(10, 300)) for i in range(6)]
    for _ in range(50):
        rng.shuffle(jobs)
        slots = simulate(jobs, NODE, 2)
        assert _score(jobs, 8, 2)[0] == max(s.end for s in slots)
