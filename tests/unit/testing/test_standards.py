import math

from miles.testing import RecipeCase, Tolerance
from miles.testing.cases import RECIPE_RUNS_GROUP
from miles.testing.standards import (
    build_standard,
    compare_to_standard,
    load_standard,
    record_command,
    standard_path,
    write_standard,
)

CASE = RecipeCase.cpu("scripts/run_x.py", metrics=("train/loss", "rollout/reward/raw_mean"))
METRICS = [{"rollout_id": 0, "train/loss": 0.25, "rollout/reward/raw_mean": 0.5},
           {"rollout_id": 1, "train/loss": 0.125, "rollout/reward/raw_mean": 0.75}]


def test_standard_round_trips_and_equal_metrics_pass(tmp_path):
    path = write_standard(standard_path(tmp_path, CASE), build_standard(CASE, METRICS, {"versions": {"torch": "x"}}))
    assert path.name == "run_x-cpu.json"
    std = load_standard(path)
    assert std["metrics"]["train/loss"] == [0.25, 0.125]
    assert compare_to_standard(CASE, METRICS, std) == []


def test_strict_comparison_catches_one_ulp():
    std = build_standard(CASE, METRICS)
    drifted = [dict(r) for r in METRICS]
    drifted[1]["train/loss"] = math.nextafter(0.125, 1.0)
    (problem,) = compare_to_standard(CASE, drifted, std)
    assert "train/loss at rollout 1" in problem and "strict" in problem


def test_registered_tolerance_allows_its_spread_only():
    case = CASE.with_(tolerances={"train/loss": Tolerance("measured 3e-7 spread", abs=1e-6)})
    std = build_standard(case, METRICS)
    drifted = [dict(r) for r in METRICS]
    drifted[0]["train/loss"] += 5e-7
    assert compare_to_standard(case, drifted, std) == []
    drifted[0]["train/loss"] += 1e-5
    assert compare_to_standard(case, drifted, std)


def test_length_change_and_missing_metric_are_reported():
    std = build_standard(CASE, METRICS)
    assert compare_to_standard(CASE, METRICS[:1], std)
    del std["metrics"]["rollout/reward/raw_mean"]
    assert any("absent from the standard" in p for p in compare_to_standard(CASE, METRICS, std))


def test_missing_standard_loads_as_none(tmp_path):
    assert load_standard(tmp_path / "nope.json") is None


def test_the_record_command_names_a_grouped_test_without_the_group_xdist_appends():
    grouped = f"tests/e2e/test_x.py::test_recipe[run_x-cpu]@{RECIPE_RUNS_GROUP}"
    assert RECIPE_RUNS_GROUP not in record_command(grouped)
