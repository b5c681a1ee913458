"""Selecting cases from the harness's case metadata."""

import json

import pytest

from ci.cases import CollectError, Selection, load_cases, select

HARNESS = [
    {"nodeid": "tests/e2e/test_recipes.py::test_gpu[wan22]", "name": "wan22_gpu", "recipe": "scripts/run_wan22.py",
     "tier": "gpu", "gpus": 8, "timeout": 3600, "est_time": 1500, "suites": ["nightly"], "labels": ["video"]},
    {"nodeid": "tests/e2e/test_recipes.py::test_gpu[sd3]", "name": "sd3_gpu", "recipe": "scripts/run_sd3.py",
     "tier": "gpu", "gpus": 2, "timeout": 1800, "est_time": 600, "suites": ["nightly"], "labels": ["image"]},
    {"nodeid": "tests/e2e/test_recipes.py::test_cpu[sd3]", "name": "sd3_cpu", "recipe": "scripts/run_sd3.py",
     "tier": "cpu", "gpus": 0, "timeout": 600, "est_time": 90, "suites": ["cpu"], "labels": ["image"]},
]


@pytest.fixture
def cases(tmp_path):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(HARNESS))
    return load_cases(path)


def names(cases):
    return [c.name for c in cases]


def test_suite_tier_and_label_filters_narrow_the_selection(cases):
    assert names(select(cases, Selection("nightly"))) == ["wan22_gpu", "sd3_gpu"]
    assert names(select(cases, Selection(None, ["cpu"]))) == ["sd3_cpu"]
    assert names(select(cases, Selection("nightly", ["gpu"], ["image"]))) == ["sd3_gpu"]
    assert names(select(cases, Selection("cpu", ["gpu"]))) == []
    assert names(select(cases, Selection(None, names=["sd3_cpu", "x"]))) == ["sd3_cpu"]


def test_harness_fields_are_kept(cases):
    wan = cases[0]
    assert (wan.gpus, wan.est_time, wan.timeout, wan.tier) == (8, 1500.0, 3600.0, "gpu")
    assert wan.nodeid.endswith("test_gpu[wan22]")


def test_synthetic_cases_belong_to_any_suite_and_default_their_tier(tmp_path):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps([{"name": "a", "gpus": 0, "est_time": 5},
                                {"name": "b", "gpus": 4, "est_time": 50}]))
    loaded = load_cases(path)
    assert names(select(loaded, Selection("nightly"))) == ["a", "b"]
    assert [c.tier for c in loaded] == ["cpu", "gpu"]


def test_repeated_case_names_are_refused(tmp_path):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps([{"name": "a", "gpus": 1, "est_time": 5}] * 2))
    with pytest.raises(CollectError, match="repeated: a"):
        load_cases(path)
