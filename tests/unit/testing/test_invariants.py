import math

from miles.testing.invariants import check_finite, check_fresh, check_parity, check_rollout_ids, check_run

P = "train/model_output_mean_abs_diff"


def rows(n, start=0, **extra):
    return [{"rollout_id": start + i, P: 0.0, "train/loss": 0.5, **extra} for i in range(n)]


def test_parity_must_be_exactly_zero_at_every_rollout():
    metrics = rows(3)
    assert check_parity(metrics) == []
    metrics[1][P] = 1e-12
    (problem,) = check_parity(metrics)
    assert "rollout 1" in problem and "exactly 0.0" in problem


def test_parity_probe_missing_is_a_failure_when_required():
    metrics = [{"rollout_id": 0, "train/loss": 1.0}]
    assert check_parity(metrics, required=True)
    assert check_parity(metrics, required=False) == []


def test_rollout_ids_must_be_contiguous_from_the_start_id():
    assert check_rollout_ids(rows(3)) == []
    assert check_rollout_ids(rows(2, start=5), start=5) == []
    gap = rows(3)
    gap[2]["rollout_id"] = 3
    assert check_rollout_ids(gap)
    assert check_rollout_ids([])


def test_fresh_run_starts_at_zero_and_is_not_resumed():
    fresh = {"resumed": False, "start_rollout_id": 0}
    assert check_fresh(rows(2), fresh) == []
    assert check_fresh(rows(2), {"resumed": True, "start_rollout_id": 0})
    assert check_fresh(rows(2, start=4), {"resumed": False, "start_rollout_id": 4})
    assert check_fresh(rows(2), None)


def test_nan_and_inf_anywhere_are_reported():
    assert check_finite(rows(2)) == []
    assert check_finite(rows(1, **{"train/grad_norm": math.nan}))
    assert check_finite(rows(1, **{"perf/x": {"nested": [1.0, math.inf]}}))


def test_check_run_reports_every_broken_invariant_at_once():
    metrics = rows(2, **{"train/loss": math.nan})
    metrics[0][P] = 0.5
    problems = check_run(metrics, {"resumed": True, "start_rollout_id": 0})
    kinds = {p.split(":")[0] for p in problems}
    assert kinds == {"parity", "fresh run", "finite"}
