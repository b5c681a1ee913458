"""The suite runner end to end, on stand-in cases (fixtures/fake_cases.py) run by pytest."""

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ci import run_suite
from ci.cases import Case
from ci.runner import RunSettings, SuiteRunner
from ci.scheduler import make_plan, plan_problems

from junit_check import junit_problems

REPO = Path(__file__).resolve().parents[3]
FIXTURE = Path(__file__).parent / "fixtures" / "fake_cases.py"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    shutil.copy(FIXTURE, tmp_path / "fake_cases.py")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # The stand-ins use nothing but pytest itself (skip, junitxml); without the installed
    # plugins each case's pytest starts in 0.2 CPU-s instead of 1.1 (the runner passes its
    # environment on to every case, so this reaches them all).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return tmp_path


def case(name, gpus, est_time=5, **extra):
    return {"name": name, "nodeid": f"fake_cases.py::{name}", "gpus": gpus,
            "est_time": est_time, **extra}


def write_suite(workdir, entries):
    path = workdir / "suite.json"
    path.write_text(json.dumps(entries))
    return path


def run_cli(workdir, entries, *extra):
    suite = write_suite(workdir, entries)
    # the stand-ins load no harness plugin, so no --miles-gpu-wait
    return run_suite.main(["--suite-json", str(suite), "--workdir", str(workdir), "--gpu-wait", "0",
                           "--out", str(workdir / "out"), *map(str, extra)])


def harness_result(workdir, name):
    return json.loads((workdir / "out" / "results" / f"{name}.json").read_text())


def test_plan_prints_makespan_and_lower_bound_and_writes_plan_json(tmp_path, capsys):
    entries = [{"name": f"c{i}", "gpus": g, "est_time": t}
               for i, (g, t) in enumerate([(8, 600), (5, 300), (2, 300), (1, 900), (4, 60)])]
    suite = write_suite(tmp_path, entries)
    code = run_suite.main(["--suite-json", str(suite), "--gpus", "8", "--plan",
                           "--plan-json", str(tmp_path / "plan.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "makespan" in out and "lower bound" in out and "ratio" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan[0]) == {"name", "gpus", "start", "end"}
    jobs = [Case(e["name"], e["gpus"], e["est_time"]).job for e in entries]
    assert plan_problems(plan, jobs, range(8)) == []


def test_plan_uses_cuda_visible_devices_as_the_pool(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    suite = write_suite(tmp_path, [{"name": "a", "gpus": 2, "est_time": 10},
                                   {"name": "b", "gpus": 1, "est_time": 10}])
    run_suite.main(["--suite-json", str(suite), "--plan", "--plan-json", str(tmp_path / "p.json")])
    used = sorted(g for e in json.loads((tmp_path / "p.json").read_text()) for g in e["gpus"])
    assert used == [3, 5, 6]


def test_a_run_with_a_failure_exits_nonzero_and_writes_valid_junit_and_summary(workdir):
    entries = [case("test_quick", 0, tier="cpu"), case("test_fails", 1), case("test_skips", 2),
               case("test_hold_a", 16)]
    assert run_cli(workdir, entries, "--gpus", "4") == 1
    junit = workdir / "out" / "junit.xml"
    assert junit_problems(junit) == []
    summary = (workdir / "out" / "summary.md").read_text()
    assert "FAILED (1 of 4)" in summary
    assert "the fixture failure" in summary
    assert "needs 16 GPUs, the node has 4" in summary
    assert harness_result(workdir, "test_quick")["cuda_visible_devices"] == ""
    assert harness_result(workdir, "test_fails")["cuda_visible_devices"] in {"0", "1", "2", "3"}


def test_a_green_run_exits_zero(workdir):
    assert run_cli(workdir, [case("test_quick", 1), case("test_skips", 1)], "--gpus", "1") == 0


def test_cases_run_at_once_on_disjoint_gpus(workdir, monkeypatch):
    monkeypatch.setenv("FAKE_HOLD", "3")
    entries = [case("test_hold_a", 2), case("test_hold_b", 1), case("test_hold_c", 1)]
    assert run_cli(workdir, entries, "--gpus", "4") == 0
    runs = [harness_result(workdir, e["name"]) for e in entries]
    assert max(r["started"] for r in runs) < min(r["ended"] for r in runs), "not concurrent"
    gpus = [g for r in runs for g in r["cuda_visible_devices"].split(",")]
    assert sorted(gpus) == ["0", "1", "2", "3"]


def test_next_case_starts_when_gpus_free_not_at_its_planned_time(workdir):
    # planned: test_quick holds all GPUs for 1000 s; it really takes about a second
    entries = [case("test_quick", 4, est_time=1000), case("test_hold_a", 4, est_time=1)]
    started = time.monotonic()
    assert run_cli(workdir, entries, "--gpus", "4") == 0
    assert time.monotonic() - started < 120


# A case that starts a child and hangs. A command case goes through the same launch, deadline and
# process-group ending as a pytest one (SuiteRunner._launch/_wait); it starts in milliseconds where
# pytest takes seconds under load, so its deadline can be short and still fall after the child starts.
HANGS = ("import os, subprocess, time\n"
         "child = subprocess.Popen(['sleep', '600'])\n"
         "open(os.environ['FAKE_PID_FILE'], 'w').write(f'{os.getpid()} {child.pid}')\n"
         "time.sleep(600)\n")


def test_a_hanging_case_is_ended_with_its_process_group(workdir, monkeypatch):
    pid_file = workdir / "pid"
    monkeypatch.setenv("FAKE_PID_FILE", str(pid_file))
    hang = Case("test_hangs", 1, 1.0, command=("{python}", "-S", "-c", HANGS), timeout=3.0)
    settings = RunSettings(workdir / "out", workdir, ["0"], timeout_grace=0.0, gpu_wait=0.0)
    (result,) = SuiteRunner([hang], make_plan([hang.job], [0]), settings).run()
    assert result.outcome == "timeout" and result.failed
    assert pid_file.exists(), "the case was ended before it started its child"
    case_pid, child_pid = map(int, pid_file.read_text().split())
    assert not alive(case_pid) and not alive(child_pid)


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_gate_fails_a_30_percent_throughput_drop_and_names_a_torch_change(workdir, monkeypatch):
    db = workdir / "history.sqlite"
    entries = [case("test_quick", 0)]
    assert run_cli(workdir, entries, "--history-db", db) == 0
    assert "no history" in (workdir / "out" / "summary.md").read_text()
    monkeypatch.setenv("FAKE_THROUGHPUT", "70")
    monkeypatch.setenv("FAKE_TORCH", "2.14.0+cpu")
    assert run_cli(workdir, entries, "--history-db", db) == 1
    summary = (workdir / "out" / "summary.md").read_text()
    assert "-30.0%" in summary and "torch 2.13.0+cpu -> 2.14.0+cpu" in summary
    assert junit_problems(workdir / "out" / "junit.xml") == []


def test_an_empty_selection_is_an_error(workdir):
    assert run_cli(workdir, [case("test_quick", 0, tier="cpu", suites=["nightly"])],
                   "--suite", "other") == 2


def test_synthetic_cases_without_node_ids_can_be_planned_but_not_run(workdir):
    assert run_cli(workdir, [{"name": "x", "gpus": 1, "est_time": 10}], "--gpus", "1") == 2


def test_runs_as_a_script_from_anywhere(tmp_path):
    suite = write_suite(tmp_path, [{"name": "x", "gpus": 1, "est_time": 10}])
    import subprocess
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "run_suite.py"), "--suite-json",
                           str(suite), "--gpus", "2", "--plan"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "makespan 10s" in proc.stdout


def test_a_real_harness_dry_case_runs_through_the_runner(tmp_path, monkeypatch):
    # the harness's own collection and result contract, on its cheapest case; whether the
    # case itself passes is the harness's business, the reports must be whole either way
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    name = "run_diffusion_grpo_tiny_cpu-dry"
    code = run_suite.main(["--suite", "cpu", "--tier", "dry", "--case", name, "--workdir", str(REPO),
                           "--out", str(tmp_path / "out")])
    assert code in (0, 1)
    assert junit_problems(tmp_path / "out" / "junit.xml") == []
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"`{name}`" in summary and "## Suite `cpu`" in summary


def test_a_cancelled_run_ends_its_cases_and_still_reports(workdir):
    import signal
    import subprocess

    pid_file = workdir / "pid"
    suite = write_suite(workdir, [case("test_hangs", 1, est_time=10, timeout=600), case("test_quick", 1)])
    env = {**os.environ, "FAKE_PID_FILE": str(pid_file)}
    proc = subprocess.Popen([sys.executable, str(REPO / "ci" / "run_suite.py"), "--suite-json",
                             str(suite), "--gpus", "1", "--gpu-wait", "0", "--workdir",
                             str(workdir), "--out", str(workdir / "out")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, output
    assert junit_problems(workdir / "out" / "junit.xml") == []
    summary = (workdir / "out" / "summary.md").read_text()
    assert "interrupted: the suite run was cancelled" in summary
    assert "not started: the suite run was cancelled" in summary
    assert not any(alive(int(pid)) for pid in pid_file.read_text().split())


SUITE = [{"name": "x", "gpus": 1, "est_time": 10}]
# bad input -> (suite file text or None, the rest of argv); {tmp} is the test's folder
BAD_INPUTS = {
    "--suite-json missing": (None, ["--suite-json", "{tmp}/none.json", "--plan"]),
    "--suite-json not JSON": ("nope", ["--plan"]),
    "--suite-json a dict": ('{"name": "x"}', ["--plan"]),
    "--suite-json an entry without a name": ('[{"gpus": 1}]', ["--plan"]),
    "--suite-json a repeated name": (json.dumps(SUITE * 2), ["--plan"]),
    "--gpus 0": (json.dumps(SUITE), ["--gpus", "0", "--plan"]),
    "an unknown flag": (json.dumps(SUITE), ["--no-such-flag"]),
    "--tier bogus": (json.dumps(SUITE), ["--tier", "bogus"]),
    "--case-env unset": (json.dumps(SUITE), ["--case-env", "MILES_TEST_SURELY_UNSET", "--plan"]),
    "--gpu-memory-gib without --gpu-shares": (json.dumps(SUITE), ["--gpu-memory-gib", "80", "--plan"]),
    "--gpu-shares over two GPUs": (json.dumps(SUITE), ["--gpu-shares", "2", "--gpu-memory-gib", "80", "--gpus", "2",
                                                       "--plan"]),
    "--plan --ray-address without --gpus": (json.dumps(SUITE), ["--ray-address", "127.0.0.1:2", "--plan"]),
    "a synthetic case run": (json.dumps(SUITE), ["--gpus", "1", "--out", "{tmp}/out"]),
    "--tests where no harness is": (None, ["--tests", "{tmp}/no-tests", "--plan"]),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_every_bad_input_ends_in_one_error_line_with_its_fix(name, tmp_path, capsys, monkeypatch):
    """Exit 2 and stderr one `error: ...; fix: ...` line (no usage block, no traceback)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("MILES_TEST_SURELY_UNSET", raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # a collection that fails, fails the same, faster
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a failed collection's whole output goes
    text, argv = BAD_INPUTS[name]
    if text is not None:
        (tmp_path / "suite.json").write_text(text)
        argv = ["--suite-json", str(tmp_path / "suite.json"), *argv]
    try:
        code = run_suite.main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "; fix: " in lines[0], lines[0]
