"""Start-up faults (docs/faults.md, "Runs that cannot start"): real runs of the tiny recipe that
fail, or wait, before rollout 0.

- a rollout engine whose constructor raises (it is given a checkpoint directory that does not
  exist, as a wrong --hf-checkpoint would): the run ends within seconds, its last line names the
  engine, its node and the CheckpointError, `[deterministic]`, and `--max-restarts 1` does not
  relaunch it;
- a train rank whose set-up raises the same way: likewise, naming the rank;
- a GPU layout on this machine, which has no GPUs: refused before Ray starts, naming the request
  and what the machine offers;
- a job laid out for two nodes on a cluster that has one; the second joins 20 s later: the run
  waits for it and finishes.

Nothing of a run may be left alive (asserted by token). Marked `faults`: `pytest tests/e2e -m faults`.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from miles.testing.cases import RecipeCase
from miles.testing.cluster import LocalRayCluster
from miles.testing.runner import RecipeRun, new_token, run_recipe, token_pids

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1800)]

RECIPE = "scripts/run_diffusion_grpo_tiny_cpu.py"
CASE = RecipeCase.cpu(RECIPE, args=("--num-rollout", "1"), own_head=True, timeout=600, est_time=120,
                      labels=("faults",))
RUN_ID = "startup"
# a start-up fault ends the run this soon after the fault fired (its marker's time) on a loaded
# 2-core machine: the failure record is written as soon as the driver's wait sees the error; the
# time is actor start-up (a Python process importing torch: ~10 s at load 10) plus one poll
END_WITHIN_S = 30.0
REFUSED_WITHIN_S = 15.0  # no Ray is started: parsing, planning and the check


def last_line(run: RecipeRun) -> str:
    lines = [line for line in run.log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def failure_record(run: RecipeRun) -> dict:
    return json.loads((run.out_dir / RUN_ID / "failure.json").read_text())


def seconds_from_fault_to_failure(run: RecipeRun, fault: str) -> float:
    return failure_record(run)["time"] - (run.out_dir / RUN_ID / "faults" / fault).stat().st_mtime


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(name, args, case=CASE, env=None, during=None) -> RecipeRun; `during(out_dir)` runs in a
    thread beside the recipe. Asserts nothing of the run is left."""
    base = tmp_path_factory.mktemp("startup")
    model_dir = os.environ.get("MILES_TEST_MODEL_DIR") or str(base / "models")

    def run(name: str, args: list[str], case: RecipeCase = CASE, env: dict | None = None,
            during=None) -> RecipeRun:
        token = new_token()
        watcher = threading.Thread(target=during, args=(base / name,), daemon=True) if during else None
        if watcher is not None:
            watcher.start()
        result = run_recipe(case, base / name, token=token, extra_args=args,
                            env={"MILES_SCRIPT_MODEL_DIR": model_dir, **(env or {})})
        if watcher is not None:
            watcher.join(timeout=300)
        _remove_ray_temp_dir(base / name)
        assert not result.survivors, result.report("processes survived SIGKILL")
        assert not result.ended, result.report("the launcher left processes for the harness to end")
        assert not token_pids(token)
        return result

    return run


def _remove_ray_temp_dir(out: Path) -> None:
    import shutil

    from miles.launcher.ray_cluster import ray_temp_dir_for

    record = out / ".launcher" / "head.json"
    if record.is_file():
        temp = json.loads(record.read_text()).get("ray_temp_dir") or ""
        if temp.startswith(ray_temp_dir_for("")):
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("fault,who,during", [
    ("engine-init@0", "rollout engine ", "failed during start"),
    ("train-setup@0", "train rank ", "failed during setup"),
], ids=["engine-raises-in-init", "train-rank-raises-in-setup"])
def test_an_actor_that_raises_at_start_up_ends_the_run_at_once_naming_it_and_is_not_restarted(runs, fault, who,
                                                                                                during):
    run = runs(fault.split("@")[0], ["--run-id", RUN_ID, "--extra-args", f"--debug-fault {fault}",
                                     "--max-restarts", "1"])
    assert run.returncode not in (0, None) and not run.timed_out, run.report()
    line = last_line(run)
    assert line.startswith("error: the training job failed"), run.report(f"last line: {line}")
    assert re.search(r"\(node \d+\.\d+\.\d+\.\d+, pid \d+\) " + during, line), run.report(f"no node and pid: {line}")
    for word in (who, during, "CheckpointError: checkpoint directory", "no-such-checkpoint",
                 "does not exist [deterministic]", "no committed checkpoint"):
        assert word in line, run.report(f"{word!r} missing from the last line: {line}")
    assert "resume" not in line and "Traceback" not in line  # no checkpoint; the traceback is in the job log
    assert "loader.py" in (run.out_dir / RUN_ID / "job.log").read_text(errors="replace")
    text = run.log_path.read_text(errors="replace")
    assert "restart 1/1" not in text and text.count("error: the training job failed") == 1
    assert [a["kind"] for a in run.run_json["attempts"]] == ["deterministic"]
    took = seconds_from_fault_to_failure(run, fault)
    print(f"{fault}: failure recorded {took:.1f}s after the fault; launcher wall time {run.wall_time:.1f}s")
    assert took <= END_WITHIN_S


def test_a_gpu_layout_on_a_machine_without_gpus_is_refused_before_ray_starts_naming_request_and_offer(runs):
    from miles.launcher.ray_cluster import visible_gpus

    if visible_gpus().count >= 2:
        pytest.skip("this machine has GPUs: the layout would fit")
    run = runs("no-gpus", ["--device", "cuda", "--run-id", RUN_ID])
    assert run.returncode == 2 and not run.timed_out, run.report()
    line = last_line(run)
    assert line.startswith("error: this machine cannot run the recipe's layout"), run.report(f"last line: {line}")
    for word in ("asks for {GPU: 1, CPU: 1} on one node", "no node has GPU 1 (the most any node has: 0)",
                 "the cluster offers 1 node(s): this machine {GPU: 0, CPU: "):
        assert word in line, f"{word!r} missing from: {line}"
    assert not (run.out_dir / ".launcher" / "head.json").exists()  # no Ray node was started
    print(f"GPU layout refused after {run.wall_time:.1f}s")
    assert run.wall_time <= REFUSED_WITHIN_S


NODE_NOTE = "the job expects 2 node(s) (--num-nodes) and 1 are alive"  # the launcher, before it submits
DRIVER_WAITS = "placement: waiting 0s of"  # the driver's first line of its wait for the nodes


def test_a_job_laid_out_for_two_nodes_waits_for_the_second_and_finishes_when_it_joins(runs):
    joined = {}
    with LocalRayCluster(nodes=1, cpus_per_node=2) as cluster:
        def second_node_joins_20_s_after_the_wait_began(out: Path) -> None:
            log = out / "recipe.log"
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and DRIVER_WAITS not in (log.read_text(errors="replace")
                                                                         if log.exists() else ""):
                time.sleep(0.5)
            joined["waiting_since"] = time.time()
            time.sleep(20)
            cluster.add_node()
            joined["at"] = time.time()

        run = runs("late-node", ["--run-id", RUN_ID, "--extra-args", "--num-nodes 2"],
                   case=CASE.with_(own_head=False, ray_nodes=1), env=cluster.env_for_recipe(),
                   during=second_node_joins_20_s_after_the_wait_began)
    assert "at" in joined, run.report("the second node never joined")
    assert run.ok, run.report()
    text = run.log_path.read_text(errors="replace")
    waited = [line for line in text.splitlines() if "node(s) alive after" in line]
    assert NODE_NOTE in text and waited, run.report("the driver did not wait for the second node")
    seconds = float(waited[0].split("alive after ")[1].split("s;")[0])
    print(f"late node: {waited[0].strip()}; run wall time {run.wall_time:.1f}s")
    assert seconds >= 15  # it waited for the node that joined 20 s after its wait began
