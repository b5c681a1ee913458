import json

import pytest

from miles.testing import RecipeCase, Tolerance, dry_cases, parametrize_cases
from miles.testing.cases import CPU_PROXY_ARGS, RECIPE_RUNS_GROUP, command_line_id, discover_recipes


def test_case_name_and_id_start_with_the_recipe_stem_so_k_selects_by_recipe():
    case = RecipeCase.cpu("scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py")
    assert case.name == "run_diffusion_grpo_wan22_pickscore_5gpu-cpu"
    assert "wan22" in case.id


def test_tier_constructors_give_tier_defaults():
    cpu = RecipeCase.cpu("scripts/run_x.py")
    assert cpu.args == CPU_PROXY_ARGS and cpu.suites == ("cpu",) and cpu.gpus == 0
    gpu = RecipeCase.gpu("scripts/run_x.py", gpus=5)
    assert gpu.tier == "gpu" and gpu.gpus == 5 and gpu.suites == ("nightly-gpu",)
    dry = RecipeCase.dry("scripts/run_x.py")
    assert dry.tier == "dry" and dry.args == () and not dry.parity


def test_marks_follow_the_tier():
    names = lambda c: {m.name for m in c.marks()}  # noqa: E731
    assert names(RecipeCase.dry("scripts/run_x.py")) >= {"e2e", "dry", "timeout"}
    gpu_marks = RecipeCase.gpu("scripts/run_x.py", gpus=4).marks()
    assert {m.name for m in gpu_marks} >= {"e2e", "nightly", "gpu"}
    assert [m.args for m in gpu_marks if m.name == "gpu"] == [(4,)]
    assert "nightly" not in names(RecipeCase.cpu("scripts/run_x.py"))


def test_cpu_runs_and_only_they_share_one_xdist_group_whose_suffix_a_rerun_command_drops():
    def groups(case):
        return [m.args for m in case.marks() if m.name == "xdist_group"]

    assert groups(RecipeCase.cpu("scripts/run_x.py")) == [(RECIPE_RUNS_GROUP,)]
    assert groups(RecipeCase.dry("scripts/run_x.py")) == groups(RecipeCase.gpu("scripts/run_x.py", gpus=1)) == []
    # loadgroup appends the group to the node id; a command that reruns the test must not carry it
    grouped = f"tests/e2e/test_x.py::test_recipe[run_x-cpu]@{RECIPE_RUNS_GROUP}"
    assert command_line_id(grouped) == "tests/e2e/test_x.py::test_recipe[run_x-cpu]"
    assert command_line_id("tests/t.py::test_a[user@host]") == "tests/t.py::test_a[user@host]"


def test_pytest_timeout_leaves_room_for_the_harness_timeout():
    case = RecipeCase.cpu("scripts/run_x.py", timeout=100)
    (mark,) = [m for m in case.marks() if m.name == "timeout"]
    assert mark.args[0] > 100


def test_gpu_tier_needs_gpus_and_other_tiers_lease_none():
    with pytest.raises(ValueError):
        RecipeCase.gpu("scripts/run_x.py", gpus=0)
    with pytest.raises(ValueError):
        RecipeCase.cpu("scripts/run_x.py", gpus=2)


def test_tolerance_needs_a_reason_and_a_compared_metric():
    with pytest.raises(ValueError):
        Tolerance(reason="", abs=1e-6)
    with pytest.raises(ValueError):
        RecipeCase.cpu("scripts/run_x.py", metrics=("train/loss",),
                       tolerances={"rollout/reward/raw_mean": Tolerance("spread 1e-7", abs=1e-6)})
    tol = Tolerance("measured spread 2e-7 across two machines", abs=1e-6)
    assert tol.allows(1.0000005, 1.0) and not tol.allows(1.00001, 1.0)


def test_parametrize_cases_rejects_duplicate_names():
    a = RecipeCase.cpu("scripts/run_x.py")
    with pytest.raises(ValueError, match="unique"):
        parametrize_cases([a, RecipeCase.cpu("scripts/run_x.py", args=("--num-rollout", "3"))])
    parametrize_cases([a, RecipeCase.cpu("scripts/run_x.py", variant="long")])


def test_dry_cases_pick_up_a_new_recipe_file_without_a_test_edit(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_a.py").write_text("")
    (tmp_path / "scripts" / "helper.py").write_text("")
    assert [c.name for c in dry_cases(tmp_path)] == ["run_a-dry"]
    (tmp_path / "scripts" / "run_b.py").write_text("")
    assert [c.name for c in dry_cases(tmp_path)] == ["run_a-dry", "run_b-dry"]
    assert discover_recipes(tmp_path) == ["scripts/run_a.py", "scripts/run_b.py"]


def test_case_json_has_the_fields_ci_reads():
    case = RecipeCase.gpu("scripts/run_x.py", gpus=2, est_time=300, labels=("wan22",))
    record = case.to_json("tests/e2e/test_x.py::test_recipe[run_x-gpu]")
    assert set(record) == {"nodeid", "name", "recipe", "tier", "gpus", "timeout", "est_time", "suites", "labels",
                           "nodes", "placement"}
    assert record["suites"] == ["nightly-gpu"] and record["labels"] == ["wan22"]
    assert record["nodes"] == 1 and record["placement"] == "STRICT_SPREAD"
    json.dumps(record)


def test_a_multi_node_gpu_case_reaches_the_cluster_runner_with_its_nodes_and_placement():
    from ci.cases import case_from_dict

    case = RecipeCase.gpu("scripts/run_x.py", gpus=16, gpu_nodes=2, placement="SPREAD", est_time=900)
    runner_case = case_from_dict(case.to_json("tests/e2e/test_x.py::test_recipe[run_x-gpu]"))
    assert (runner_case.gpus, runner_case.nodes, runner_case.gpus_per_node, runner_case.placement) == (16, 2, 8, "SPREAD")


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=6, gpu_nodes=4), "gpu_nodes=4 must divide"),
    (dict(gpus=4, gpu_nodes=2, placement="RANDOM"), "placement must be one of"),
])
def test_gpu_nodes_and_placement_are_checked_when_the_case_is_declared(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecipeCase.gpu("scripts/run_x.py", **kwargs)
    with pytest.raises(ValueError, match="gpu_nodes=2 must divide"):
        RecipeCase.cpu("scripts/run_x.py", gpu_nodes=2)


def test_script_path_is_found_from_a_subdirectory(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_a.py").write_text("")
    (tmp_path / "tests").mkdir()
    case = RecipeCase.cpu("scripts/run_a.py")
    assert case.script_path(tmp_path / "tests") == tmp_path / "scripts" / "run_a.py"
    assert case.repo_root(tmp_path / "tests") == tmp_path


def test_cpu_cases_share_their_workers_cluster_unless_they_ask_for_their_own_head():
    assert RecipeCase.cpu("scripts/run_x.py").uses_shared_cluster
    assert not RecipeCase.cpu("scripts/run_x.py", own_head=True).uses_shared_cluster
    assert not RecipeCase.cpu("scripts/run_x.py", ray_nodes=2).uses_shared_cluster
    assert not RecipeCase.gpu("scripts/run_x.py", gpus=1).uses_shared_cluster
