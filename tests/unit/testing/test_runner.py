"""Real-run process control, with fixture scripts standing in for recipes."""

import os
import subprocess
import sys
import textwrap
import time

from miles.testing import RecipeCase
from miles.testing.runner import TOKEN_ENV, end_processes, new_token, run_recipe, token_pids, write_result_record

# A "recipe" that starts a daemon in a session of its own (as `ray start` does), prints a
# numbered log, then hangs (or exits when told to).
DAEMONIZING = textwrap.dedent('''
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    for i in range(300):
        print(f"log line {i}", flush=True)
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
    time.sleep(600)
''')


def write_recipe(tmp_path, body=DAEMONIZING, name="run_fixture.py"):
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts" / name).write_text(body)
    return f"scripts/{name}"


def test_hanging_run_is_ended_at_its_timeout_with_the_log_tail_and_nothing_left(tmp_path):
    case = RecipeCase.cpu(write_recipe(tmp_path), args=(), timeout=3, root=tmp_path)
    start = time.monotonic()
    run = run_recipe(case, tmp_path / "out", grace=2)
    assert time.monotonic() - start < 20
    assert run.timed_out and not run.ok
    assert len(run.ended) >= 2  # the recipe and its setsid'd daemon
    assert run.survivors == [] and token_pids(run.token) == []
    report = run.report()
    assert "timed out after 3s" in report
    assert "log line 299" in report and "log line 99\n" not in report  # last 200 lines only
    assert "command:" in report


def test_daemon_left_behind_by_a_finished_run_is_ended_and_recorded(tmp_path):
    case = RecipeCase.cpu(write_recipe(tmp_path), args=("--exit", "0"), timeout=30, root=tmp_path)
    run = run_recipe(case, tmp_path / "out", grace=2)
    assert run.returncode == 0 and not run.timed_out
    assert any("time.sleep(600)" in p for p in run.ended)
    assert run.survivors == [] and token_pids(run.token) == []
    assert run.ok


def test_failed_run_reports_exit_code(tmp_path):
    case = RecipeCase.cpu(write_recipe(tmp_path), args=("--exit", "3"), timeout=30, root=tmp_path)
    run = run_recipe(case, tmp_path / "out", grace=2)
    assert run.returncode == 3 and not run.ok
    assert "exited with code 3" in run.report()


def test_token_scan_finds_only_processes_carrying_the_token():
    token = new_token()
    env = dict(os.environ, **{TOKEN_ENV: token})
    sleeper = "import time; print('up', flush=True); time.sleep(60)"
    marked = subprocess.Popen([sys.executable, "-c", sleeper], env=env, start_new_session=True, stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True, stdout=subprocess.PIPE)
    try:
        # until the child has exec'd, /proc/<pid>/environ is still the parent's, without the token
        assert marked.stdout.readline() == b"up\n" and other.stdout.readline() == b"up\n"
        assert token_pids(token) == [marked.pid]
        ended, survivors = end_processes(token, grace=2, reap=[marked])
        assert survivors == [] and len(ended) == 1
        assert other.poll() is None  # an unmarked process is untouched
    finally:
        other.kill()
        other.wait()
        marked.kill()
        marked.wait()


def test_sigterm_ignoring_process_gets_sigkill_after_the_grace(tmp_path):
    token = new_token()
    env = dict(os.environ, **{TOKEN_ENV: token})
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
        env=env, start_new_session=True)
    time.sleep(0.5)
    ended, survivors = end_processes(token, grace=1, reap=[stubborn])
    assert survivors == [] and stubborn.wait(timeout=5) == -9


def test_result_record_has_throughput_and_peak_memory(tmp_path):
    body = textwrap.dedent('''
        import json, os, sys
        out = sys.argv[sys.argv.index("--output-dir") + 1]
        rd = os.path.join(out, "run1"); os.makedirs(rd)
        rows = [{"rollout_id": i, "perf/train_pairs_per_sec": 10.0 + i, "perf/peak_memory_bytes": 100 * (i + 1)} for i in range(2)]
        open(os.path.join(rd, "metrics.jsonl"), "w").write("\\n".join(json.dumps(r) for r in rows) + "\\n")
        json.dump({"argv": ["--x"], "resumed": False, "start_rollout_id": 0}, open(os.path.join(rd, "run.json"), "w"))
    ''')
    case = RecipeCase.cpu(write_recipe(tmp_path, body), args=(), timeout=30, root=tmp_path)
    run = run_recipe(case, tmp_path / "out")
    record = run.result_record("passed", "n::id")
    assert record["throughput"] == {"last": 11.0, "mean": 10.5}
    assert record["peak_memory"] == 200
    assert record["run_json"]["resumed"] is False
    path = write_result_record(tmp_path / "results", record)
    assert path.name == f"{case.name}.json"


def test_perf_comes_from_perf_jsonl_when_metrics_jsonl_omits_it(tmp_path):
    body = textwrap.dedent('''
        import json, os, sys
        out = sys.argv[sys.argv.index("--output-dir") + 1]
        rd = os.path.join(out, "run1"); os.makedirs(rd)
        open(os.path.join(rd, "metrics.jsonl"), "w").write(json.dumps({"rollout_id": 0, "train/loss": 1.0}) + "\\n")
        perf = {"rollout_id": 0, "perf/train_pairs_per_sec": 7.0, "perf/peak_memory_bytes": 5, "perf/step_time": 1.5}
        open(os.path.join(rd, "perf.jsonl"), "w").write(json.dumps(perf) + "\\n")
    ''')
    case = RecipeCase.cpu(write_recipe(tmp_path, body), args=(), timeout=30, root=tmp_path)
    run = run_recipe(case, tmp_path / "out")
    assert run.result_record("passed")["throughput"] == {"last": 7.0, "mean": 7.0}
    assert run.training_time() == 1.5
