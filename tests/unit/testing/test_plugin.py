"""The plugin as users meet it: pytest runs in a scratch repository (pytester), loaded with -p."""

import json
import re
import shutil
import textwrap
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "scripts" / "run_diffusion_grpo_tiny_cpu.py"
DRY_TEST = REPO / "tests" / "e2e" / "test_dry.py"

CASES_MODULE = textwrap.dedent('''
    from miles.testing import RecipeCase, Signal, parametrize_cases
    CASES = [
        # own_head: the stand-in recipe starts no Ray, so it needs no shared cluster either
        RecipeCase.cpu("scripts/run_fixture.py", args=(), timeout={timeout}, metrics={metrics},
                       signals={signals}, own_head=True),
        RecipeCase.gpu("scripts/run_fixture.py", gpus=2, est_time=600, labels=("fixture",)),
    ]

    @parametrize_cases(CASES)
    def test_recipe(recipe_case, run_recipe, check_run):
        check_run(run_recipe(recipe_case))
''')

# Writes what the trainer writes: metrics.jsonl (parity exactly 0.0) and run.json.
GOOD_RECIPE = textwrap.dedent('''
    import json, os, sys
    out = sys.argv[sys.argv.index("--output-dir") + 1]
    rd = os.path.join(out, "run-1"); os.makedirs(rd)
    rows = [{"rollout_id": i, "train/loss": 0.5 / (i + 1), "train/model_output_mean_abs_diff": 0.0,
             "perf/train_pairs_per_sec": 4.0, "perf/peak_memory_bytes": 1000} for i in range(2)]
    with open(os.path.join(rd, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\\n" for r in rows))
    fingerprint = {"torch_cpu_capability": os.environ.get("FAKE_CAPABILITY", "AVX2"),
                   "packages": {"transformers": os.environ.get("FAKE_TRANSFORMERS", "5.24.0")}}
    json.dump({"argv": ["--lr", "1"], "resumed": False, "start_rollout_id": 0, "versions": {"torch": "t"},
               "fingerprint": fingerprint}, open(os.path.join(rd, "run.json"), "w"))
    print("trained", flush=True)
''')

HANGING_RECIPE = textwrap.dedent('''
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    for i in range(500):
        print(f"step {i}", flush=True)
    time.sleep(600)
''')


@pytest.fixture(autouse=True)
def _own_results_dir(monkeypatch):
    """Inner pytest runs must not write records into an outer CI run's MILES_RESULTS_DIR."""
    monkeypatch.delenv("MILES_RESULTS_DIR", raising=False)


# pytest plugins installed here that the harness neither uses nor touches; an inner session that
# loads them spends about 1 s of CPU importing them (hypothesis most), a third of its cost
_UNRELATED_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:benchmark")


def _inner(pytester, *args):
    """pytest in the scratch repository, in its own interpreter, with the plugin loaded as users load it."""
    return pytester.runpytest_subprocess("-p", "miles.testing", *_UNRELATED_PLUGINS, *args)


def scratch_repo(pytester, recipe_body, timeout=60, metrics=("train/loss",), signals='(Signal("train/loss", "falls"),)'):
    pytester.mkdir("scripts")
    (pytester.path / "scripts" / "run_fixture.py").write_text(recipe_body)
    pytester.makepyfile(test_cases=CASES_MODULE.format(timeout=timeout, metrics=tuple(metrics), signals=signals))


def test_markers_are_registered_so_strict_markers_accepts_them(pytester):
    pytester.makepyfile(textwrap.dedent('''
        import pytest
        @pytest.mark.gpu(2)
        @pytest.mark.e2e
        @pytest.mark.dry
        @pytest.mark.nightly
        def test_x():
            pass
    '''))
    result = _inner(pytester, "--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    markers = _inner(pytester, "--markers")
    markers.stdout.fnmatch_lines(["*gpu(n)*", "*nightly*"])


def test_slow_and_fault_tests_run_only_when_their_marker_option_or_file_is_named(pytester):
    pytester.makepyfile(test_mixed=textwrap.dedent('''
        import pytest
        def test_fast():
            pass
        @pytest.mark.slow
        def test_deep():
            pass
        @pytest.mark.faults
        def test_fault():
            pass
    '''))
    plain = _inner(pytester, "-p", "no:cacheprovider", ".")
    plain.assert_outcomes(passed=1, deselected=2)
    _inner(pytester, "-p", "no:cacheprovider", "-m", "slow").assert_outcomes(passed=1, deselected=2)
    _inner(pytester, "-p", "no:cacheprovider", "--miles-slow", ".").assert_outcomes(passed=2, deselected=1)
    # a file named on the command line is asked for whole, as a node id is
    _inner(pytester, "-p", "no:cacheprovider", "test_mixed.py").assert_outcomes(passed=3)


def test_cases_json_lists_every_collected_case_for_ci(pytester, tmp_path):
    scratch_repo(pytester, GOOD_RECIPE)
    out = tmp_path / "cases.json"
    result = _inner(pytester, "--collect-only", "-q", "--miles-cases-json", str(out))
    result.stdout.fnmatch_lines(["*test_recipe?run_fixture-cpu?", "*test_recipe?run_fixture-gpu?"])
    cases = {c["name"]: c for c in json.loads(out.read_text())}
    assert set(cases) == {"run_fixture-cpu", "run_fixture-gpu"}
    gpu = cases["run_fixture-gpu"]
    assert gpu["tier"] == "gpu" and gpu["gpus"] == 2 and gpu["suites"] == ["nightly-gpu"]
    assert gpu["est_time"] == 600 and gpu["labels"] == ["fixture"] and gpu["recipe"] == "scripts/run_fixture.py"
    assert gpu["nodeid"].endswith("test_recipe[run_fixture-gpu]")


def test_gpu_case_skips_with_its_reason_without_nvml_and_cpu_case_runs(pytester, tmp_path, monkeypatch):
    scratch_repo(pytester, GOOD_RECIPE)
    monkeypatch.setenv("MILES_RESULTS_DIR", str(tmp_path / "results"))
    _inner(pytester, "--miles-record-standards", "-k", "cpu")
    result = _inner(pytester, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*GPU tier: NVML*"])
    record = json.loads((tmp_path / "results" / "run_fixture-cpu.json").read_text())
    assert record["outcome"] == "passed" and record["throughput"] == {"last": 4.0, "mean": 4.0}
    assert record["peak_memory"] == 1000 and record["run_json"]["resumed"] is False
    assert json.loads((tmp_path / "results" / "run_fixture-gpu.json").read_text())["outcome"] == "skipped"


def test_standards_are_written_only_on_request_and_then_compared_strictly(pytester):
    scratch_repo(pytester, GOOD_RECIPE)
    standard = pytester.path / "standards" / "run_fixture-cpu.json"
    missing = _inner(pytester, "-k", "cpu")
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*no committed metric standard*", "*--miles-record-standards*"])
    assert not standard.exists()
    _inner(pytester, "-k", "cpu", "--miles-record-standards").assert_outcomes(passed=1)
    assert json.loads(standard.read_text())["metrics"]["train/loss"] == [0.5, 0.25]
    _inner(pytester, "-k", "cpu").assert_outcomes(passed=1)
    data = json.loads(standard.read_text())
    data["metrics"]["train/loss"][1] = 0.25000000000000006
    standard.write_text(json.dumps(data))
    drifted = _inner(pytester, "-k", "cpu")
    drifted.assert_outcomes(failed=1)
    drifted.stdout.fnmatch_lines(["*train/loss at rollout 1*strict*"])


def test_parity_regression_fails_the_run_even_with_a_standard(pytester):
    scratch_repo(pytester, GOOD_RECIPE.replace('"train/model_output_mean_abs_diff": 0.0',
                                               '"train/model_output_mean_abs_diff": 1e-9'), metrics=())
    result = _inner(pytester, "-k", "cpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*parity broken at rollout 0*exactly 0.0*"])


def test_hanging_case_is_ended_at_its_timeout_with_log_tail_and_no_survivor(pytester, tmp_path, monkeypatch):
    scratch_repo(pytester, HANGING_RECIPE, timeout=3)
    monkeypatch.setenv("MILES_RESULTS_DIR", str(tmp_path / "results"))
    result = _inner(pytester, "-k", "cpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*timed out after 3s and was ended*", "*processes ended by the harness*",
                                 "*last 200 lines*", "*step 499*"])
    assert "step 299\n" not in result.stdout.str()
    record = json.loads((tmp_path / "results" / "run_fixture-cpu.json").read_text())
    assert record["outcome"] == "failed" and record["timed_out"] is True
    # The daemon that left the recipe's session carried the token and is gone too. SIGKILL is
    # delivered asynchronously: on a loaded machine a killed process can still be listed for a moment.
    deadline = time.monotonic() + 10
    while (leftover := _token_sleepers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover == []


def _token_sleepers():
    return [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).startswith(
        "python") and "time.sleep(600)" in _cmdline(p) and _env_has(p, "MILES_TEST_TOKEN=")]


def _cmdline(p):
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split("/")[-1]
    except OSError:
        return ""


def _env_has(p, needle):
    try:
        return needle.encode() in (p / "environ").read_bytes()
    except OSError:
        return False


def copy_repo(pytester, recipes):
    """A scratch repository laid out like this one: scripts/ with the given recipes and the
    real tests/e2e/test_dry.py."""
    (pytester.path / "scripts").mkdir()
    for name, text in recipes.items():
        (pytester.path / "scripts" / name).write_text(text)
    (pytester.path / "tests" / "e2e").mkdir(parents=True)
    shutil.copy(DRY_TEST, pytester.path / "tests" / "e2e" / "test_dry.py")


def test_new_recipe_with_non_dividing_pair_shards_fails_its_dry_check_with_no_test_edit(pytester):
    grpo = 'U.flow_grpo_args(clip_range="1e-2")'
    assert TINY.read_text().count(grpo) == 1, "the tiny recipe's GRPO block changed"
    bad = TINY.read_text().replace(grpo, 'U.flow_grpo_args(clip_range="1e-2", steps_per_rollout=3)')
    copy_repo(pytester, {"run_my_new_recipe.py": bad})
    result = _inner(pytester, "tests/e2e", "-k", "my_new_recipe")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*num_pairs_shard=64 not divisible by num_steps_per_rollout=3*"])


def test_recipe_without_snapshot_fails_naming_the_command_that_records_it(pytester):
    copy_repo(pytester, {"run_fresh.py": TINY.read_text()})
    result = _inner(pytester, "tests/e2e")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "No plan snapshot is recorded" in out
    assert "pytest 'tests/e2e/test_dry.py::test_dry[run_fresh-dry]' --snapshot-update" in out


def test_editing_one_flag_fails_only_that_recipes_snapshot_and_snapshot_update_fixes_it(pytester):
    copy_repo(pytester, {"run_one.py": TINY.read_text(), "run_two.py": TINY.read_text()})
    _inner(pytester, "tests/e2e", "--snapshot-update").assert_outcomes(passed=2)
    one = pytester.path / "scripts" / "run_one.py"
    recorded_lr = re.search(r'optimizer_args\(lr="([^"]+)"', one.read_text()).group(1)
    assert recorded_lr != "5e-4"
    one.write_text(one.read_text().replace(f'optimizer_args(lr="{recorded_lr}"', 'optimizer_args(lr="5e-4"'))
    result = _inner(pytester, "tests/e2e")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_dry?run_one-dry?*"])
    result.stdout.fnmatch_lines([f"*- --lr {recorded_lr}*", "*+ --lr 5e-4*"])
    _inner(pytester, "tests/e2e", "--snapshot-update").assert_outcomes(passed=2)
    _inner(pytester, "tests/e2e").assert_outcomes(passed=2)


def test_locked_flag_overridden_by_extra_args_is_caught(pytester):
    # Whether the launcher refuses it or the dry check catches it, the dry case must fail.
    recipe = TINY.read_text().replace(
        "U.execute_train(train_args=train_args, num_gpus_per_node=0, config=args)",
        "U.execute_train(train_args=train_args, num_gpus_per_node=0, config=args, locked_flags=['--lr'])")
    recipe = recipe.replace("extra_args: str", "extra_args: str")
    copy_repo(pytester, {"run_locked.py": recipe})
    _inner(pytester, "tests/e2e", "--snapshot-update").assert_outcomes(passed=1)
    env_recipe = pytester.path / "scripts" / "run_locked.py"
    env_recipe.write_text(recipe.replace("if __name__ == \"__main__\":", "import sys\nsys.argv += ['--extra-args', '--lr 1e-2']\nif __name__ == \"__main__\":"))
    result = _inner(pytester, "tests/e2e")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--lr*"])


def test_other_environment_names_what_changed_first_and_still_fails_on_parity_or_a_missing_signal(
        pytester, monkeypatch):
    scratch_repo(pytester, GOOD_RECIPE)
    _inner(pytester, "-k", "cpu", "--miles-record-standards").assert_outcomes(passed=1)
    standard = pytester.path / "standards" / "run_fixture-cpu.json"
    assert json.loads(standard.read_text())["fingerprint"]["torch_cpu_capability"] == "AVX2"
    # a run on another environment whose numbers also moved: the strict series is not compared
    monkeypatch.setenv("FAKE_CAPABILITY", "AVX512")
    monkeypatch.setenv("FAKE_TRANSFORMERS", "5.23.0")
    (pytester.path / "scripts" / "run_fixture.py").write_text(GOOD_RECIPE.replace("0.5 / (i + 1)", "0.6 / (i + 1)"))
    moved = _inner(pytester, "-k", "cpu", "-W", "default")
    moved.assert_outcomes(passed=1)
    moved.stdout.fnmatch_lines(["*run_fixture-cpu: environment differs from the standard's: "
                                "torch CPU capability AVX2 -> AVX512; transformers 5.24.0 -> 5.23.0*"
                                "strict series not compared*"])
    # ... but a run without its learning signal fails, the difference named first
    (pytester.path / "scripts" / "run_fixture.py").write_text(GOOD_RECIPE.replace("0.5 / (i + 1)", "0.5 * (i + 1)"))
    flat = _inner(pytester, "-k", "cpu")
    flat.assert_outcomes(failed=1)
    flat.stdout.fnmatch_lines(["*run_fixture-cpu: environment differs*AVX2 -> AVX512*",
                               "*learning signal 'train/loss falls': 0.5 -> 1.0*"])
    # ... and so does a broken parity
    (pytester.path / "scripts" / "run_fixture.py").write_text(
        GOOD_RECIPE.replace('"train/model_output_mean_abs_diff": 0.0', '"train/model_output_mean_abs_diff": 1e-9'))
    broken = _inner(pytester, "-k", "cpu")
    broken.assert_outcomes(failed=1)
    broken.stdout.fnmatch_lines(["*run_fixture-cpu: environment differs*AVX2 -> AVX512*",
                                 "*parity broken at rollout 0*"])


def test_recording_refuses_a_standard_that_pins_nothing(pytester):
    scratch_repo(pytester, GOOD_RECIPE.replace("0.5 / (i + 1)", "0.0"), signals="()")
    result = _inner(pytester, "-k", "cpu", "--miles-record-standards")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*refusing to record*", "*train/loss is constant*compares nothing*"])
    assert not (pytester.path / "standards" / "run_fixture-cpu.json").exists()


def test_the_cpu_runs_on_the_shared_cluster_come_first_and_nothing_else_moves():
    from types import SimpleNamespace

    from miles.testing import RecipeCase
    from miles.testing.plugin import _shared_cluster_runs_first

    def item(case):
        return SimpleNamespace(callspec=SimpleNamespace(params={"recipe_case": case}), name=case.name)

    own_head = RecipeCase.cpu("scripts/run_a.py", own_head=True)
    two_nodes = RecipeCase.cpu("scripts/run_b.py", ray_nodes=2)
    shared_c, shared_d = RecipeCase.cpu("scripts/run_c.py"), RecipeCase.cpu("scripts/run_d.py")
    dry, gpu = RecipeCase.dry("scripts/run_a.py"), RecipeCase.gpu("scripts/run_a.py", gpus=1)
    unit = SimpleNamespace(name="test_unit")
    items = [item(own_head), unit, item(dry), item(two_nodes), item(shared_c), item(gpu), item(shared_d)]
    _shared_cluster_runs_first(items)
    assert [i.name for i in items] == [shared_c.name, "test_unit", dry.name, shared_d.name, own_head.name,
                                       gpu.name, two_nodes.name]
