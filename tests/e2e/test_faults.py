"""The fault suite (docs/faults.md): one real run of the tiny recipe per fault, on its own Ray head.

Each case injects its fault at rollout 1 of a 3-rollout run that saves after every rollout (so
rollout 0 is the last committed checkpoint when the fault strikes) and asserts what
docs/faults.md promises: the run ends within 30 s of the fault (of the deadline, for a hang), the
launcher's last line names the role, rank, node, cause, last checkpoint and the resume command, the
exit status is non-zero, nothing carrying the run's token is left, the last checkpoint loads and
`latest` names it, no checkpoint follows a NaN; with --max-restarts 1 an infrastructure failure
is restarted once and ends bit for bit like an uninterrupted run.

Marked `faults`: deselected from the default run (it takes several minutes on 2 cores); run it
with `pytest tests/e2e -m faults` (or `--miles-faults`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from miles.testing.cases import RecipeCase
from miles.testing.runner import RecipeRun, new_token, run_recipe, token_pids

pytestmark = [pytest.mark.faults, pytest.mark.timeout(2400)]

RECIPE = "scripts/run_diffusion_grpo_tiny_cpu.py"
CASE = RecipeCase.cpu(RECIPE, args=("--num-rollout", "3"), own_head=True, timeout=900, est_time=300,
                      labels=("faults",))
RUN_ID = "faulty"
EXTRA = "--save-interval 1 --remote-timeout-min-s 20 --remote-timeout-factor 5"
END_WITHIN_S = 30.0


def extra_args(fault: str | None = None, *more: str, max_restarts: int = 0) -> list[str]:
    extra = EXTRA + (f" --debug-fault {fault}" if fault else "")
    return ["--run-id", RUN_ID, "--extra-args", extra, "--max-restarts", str(max_restarts), *more]


def save_dir(run: RecipeRun) -> Path:
    return run.out_dir / RUN_ID / "checkpoints"


def last_line(run: RecipeRun) -> str:
    lines = [l for l in run.log_path.read_text(errors="replace").splitlines() if l.strip()]
    return lines[-1] if lines else ""


def fault_time(run: RecipeRun, fault: str) -> float:
    return (run.out_dir / RUN_ID / "faults" / fault).stat().st_mtime


def ended_at(run: RecipeRun) -> float:
    return run.log_path.stat().st_mtime


@pytest.fixture(scope="module")
def foreign_ray_names():
    """Processes named like Ray's daemons, started before the suite: they must outlive it."""
    procs = [subprocess.Popen(["bash", "-c", f"exec -a {name} sleep 3600"], start_new_session=True)
             for name in ("raylet", "gcs_server")]
    yield procs
    alive = [p.poll() is None for p in procs]
    for p in procs:
        p.kill()
        p.wait()
    assert all(alive), "a process named raylet or gcs_server that the suite did not start was ended"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, foreign_ray_names):
    """run(name, extra_args, during=None) -> RecipeRun; checks nothing of the run's is left."""
    base = tmp_path_factory.mktemp("faults")
    model_dir = os.environ.get("MILES_TEST_MODEL_DIR") or str(base / "models")

    def run(name: str, args: list[str], during=None) -> RecipeRun:
        token = new_token()
        out = base / name
        watcher = None
        if during is not None:
            watcher = threading.Thread(target=during, args=(out, token), daemon=True)
            watcher.start()
        result = run_recipe(CASE, out, token=token, extra_args=args, env={"MILES_SCRIPT_MODEL_DIR": model_dir})
        if watcher is not None:
            watcher.join(timeout=60)
        left_temp_dir = _remove_ray_temp_dir(out)  # first: a failed assertion must not leave a Ray session behind
        assert not left_temp_dir, result.report(f"the launcher left its Ray temp dir {left_temp_dir} (no --keep-ray-logs)")
        assert not result.survivors, result.report("processes survived SIGKILL")
        assert not result.ended, result.report("the launcher left processes for the harness to end")  # incl. respawns
        assert not token_pids(token)
        return result

    run.model_dir = Path(model_dir)
    return run


def _remove_ray_temp_dir(out: Path) -> str | None:
    """The launcher removes its head's temp dir on every exit path; should one be left, the suite
    removes it (no Ray session outlives the suite) and returns its path."""
    import shutil

    from miles.launcher.ray_cluster import ray_temp_dir_for

    record = out / ".launcher" / "head.json"
    if record.is_file():
        temp = json.loads(record.read_text()).get("ray_temp_dir") or ""
        if temp.startswith(ray_temp_dir_for("")) and Path(temp).exists():
            shutil.rmtree(temp, ignore_errors=True)
            return temp
    return None


@pytest.fixture(scope="module")
def uninterrupted(runs) -> RecipeRun:
    run = runs("whole", extra_args())
    assert run.ok, run.report()
    return run


def weights(run: RecipeRun) -> dict:
    from safetensors.torch import load_file

    from miles.backends.checkpoint import latest_checkpoint

    found = latest_checkpoint(save_dir(run))
    assert found is not None
    return {k: v for k, v in load_file(str(found[1] / "model_transformer.safetensors")).items()}


def assert_same_as_uninterrupted(run: RecipeRun, whole: RecipeRun) -> None:
    ours, theirs = run.out_dir / RUN_ID / "metrics.jsonl", whole.out_dir / RUN_ID / "metrics.jsonl"
    assert ours.read_bytes() == theirs.read_bytes(), run.report("metrics differ from the uninterrupted run")
    a, b = weights(run), weights(whole)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def assert_checkpoint_loads(run: RecipeRun, rollout_id: int) -> None:
    import torch
    from safetensors.torch import load_file

    from miles.backends.checkpoint import checkpoint_name, latest_checkpoint

    found = latest_checkpoint(save_dir(run))
    assert found is not None and found[0] == rollout_id, f"latest is {found}, expected rollout {rollout_id}"
    assert (save_dir(run) / "latest").read_text().strip() == checkpoint_name(rollout_id)
    assert load_file(str(found[1] / "model_transformer.safetensors"))
    torch.load(found[1] / "driver.pt", weights_only=False)


def assert_failure_line(run: RecipeRun, *words: str, resumable: bool = True) -> str:
    """The launcher's last line names the fault; the resume command only after a cause that does
    not repeat (a deterministic one would fail the same way again)."""
    line = last_line(run)
    assert line.startswith("error: the training job failed"), run.report(f"last line: {line}")
    hint = ("resume: python3 ", "--load ") if resumable else ("not resumable as is",)
    for word in (*words, "node ", "last committed checkpoint", *hint):
        assert word in line, run.report(f"{word!r} missing from the last line: {line}")
    assert resumable or "resume:" not in line, run.report(f"a resume command after a deterministic cause: {line}")
    return line


def restart_line(run: RecipeRun) -> str:
    lines = [l for l in run.log_path.read_text(errors="replace").splitlines() if l.startswith("restart 1/1: ")]
    assert lines, run.report("no restart line")
    return lines[0]


def assert_restarted_once(run: RecipeRun, whole: RecipeRun, fault: str, *words: str) -> None:
    assert run.ok, run.report()
    line = restart_line(run)
    for word in (*words, "node ", "[infrastructure]", "resuming at 1"):
        assert word in line, f"{word!r} missing from: {line}"
    record = run.run_json
    assert record["resumed"] is True and record["start_rollout_id"] == 1
    attempts = record["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2] and record["restarts"] == 1
    assert attempts[0]["kind"] == "infrastructure" and attempts[0]["exit"] != 0 and attempts[0]["cause"]
    assert attempts[1]["resumed_from_rollout"] == 1 and attempts[1]["exit"] == 0
    assert_same_as_uninterrupted(run, whole)


# -- a-c: actors that die, restarted once, end bit for bit like an uninterrupted run --------------

@pytest.mark.parametrize("fault,words", [
    ("train-kill@1", ("train rank 0", "during train", "ActorDiedError")),
    ("engine-kill@1", ("rollout engine 0", "during generate", "ActorDiedError")),
    ("reward-kill@1", ("reward worker 0", "during score", "ActorDiedError")),
], ids=["a-train-rank-sigkill", "b-engine-sigkill", "c-reward-worker-sigkill"])
def test_dead_actor_is_restarted_once_and_ends_like_an_uninterrupted_run(runs, uninterrupted, fault, words):
    run = runs(fault.split("@")[0], extra_args(fault, max_restarts=1))
    assert_restarted_once(run, uninterrupted, fault, *words)
    restarted_at = next(l for l in run.log_path.read_text().splitlines() if l.startswith("restart 1/1"))
    assert restarted_at  # timing: the first attempt ended within END_WITHIN_S of the fault
    assert _first_attempt_seconds(run, fault) <= END_WITHIN_S


def _first_attempt_seconds(run: RecipeRun, fault: str) -> float:
    """Seconds from the fault to the end of the attempt it broke (the failure record's time)."""
    record = run.out_dir / RUN_ID / "failure.attempt1.json"
    return json.loads(record.read_text())["time"] - fault_time(run, fault)


# -- c: a reward worker that hangs: the deadline ends the run; its resume command resumes exactly --

def test_hung_reward_worker_ends_at_its_deadline_and_the_printed_command_resumes_exactly(runs, uninterrupted):
    run = runs("reward-hang", extra_args("reward-hang@1"))
    assert run.returncode not in (0, None) and not run.timed_out
    line = assert_failure_line(run, "reward worker 0", "no answer to score within", "[infrastructure]")
    assert ended_at(run) - fault_time(run, "reward-hang@1") <= 20 + END_WITHIN_S
    assert_checkpoint_loads(run, 0)
    # the exact command the line prints, with the output dir it ran with
    command = shlex.split(line.split("resume: ", 1)[1].split("; job log: ")[0])
    assert command[:2] == ["python3", RECIPE]
    resumed = runs("reward-hang", [*command[2:]])  # same output dir: same run dir, same checkpoints
    assert resumed.ok, resumed.report()
    assert resumed.run_json["resumed"] is True and resumed.run_json["start_rollout_id"] == 1
    assert_same_as_uninterrupted(resumed, uninterrupted)


# -- g: a NaN is deterministic: never saved, never restarted ---------------------------------------

def test_nan_loss_stops_the_run_before_the_update_is_saved_and_is_not_restarted(runs):
    run = runs("nan", extra_args("nan@1", max_restarts=1))
    assert run.returncode not in (0, None)
    line = assert_failure_line(run, "train rank 0", "non-finite train/loss=nan", "[deterministic]",
                               resumable=False)
    assert "restart 1/1" not in run.log_path.read_text()
    assert ended_at(run) - fault_time(run, "nan@1") <= END_WITHIN_S
    assert_checkpoint_loads(run, 0)
    assert not (save_dir(run) / "rollout_000001").exists()
    assert [a["kind"] for a in run.run_json["attempts"]] == ["deterministic"], line


# -- e: the launcher gets SIGTERM during a save ----------------------------------------------------

def test_sigterm_to_the_launcher_during_a_save_keeps_the_last_checkpoint_and_resumes_exactly(runs, uninterrupted):
    signalled = {}

    def sigterm_launcher_during_save(out: Path, token: str) -> None:
        wait_for_path(out / RUN_ID / "checkpoints" / ".staging_rollout_000001")
        time.sleep(1.0)  # the save is being written (slow-save holds the background write 60 s)
        for pid in token_pids(token):
            if _is_launcher(pid):
                os.kill(pid, signal.SIGTERM)
                signalled["at"] = time.time()

    run = runs("sigterm", extra_args("slow-save@1", max_restarts=1), during=sigterm_launcher_during_save)
    assert "at" in signalled, run.report("the save never started")
    assert run.returncode not in (0, None)
    assert_failure_line(run, "launcher", "received SIGTERM", "[interrupted]")
    assert "restart 1/1" not in run.log_path.read_text()
    assert ended_at(run) - signalled["at"] <= END_WITHIN_S
    assert_checkpoint_loads(run, 0)
    line = last_line(run)
    command = shlex.split(line.split("resume: ", 1)[1].split("; job log: ")[0])
    resumed = runs("sigterm", [*command[2:]])
    assert resumed.ok, resumed.report()
    assert_same_as_uninterrupted(resumed, uninterrupted)


def wait_for_path(path: Path, timeout: float = 300.0) -> None:
    """Until the run writes `path` (the test then injects its fault), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _is_launcher(pid: int) -> bool:
    """The recipe process (role launcher): the run's own python running the recipe script."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(argv) > 1 and argv[1].decode(errors="replace").endswith(RECIPE)


# -- f: the disk fills during a save ---------------------------------------------------------------

def test_full_disk_during_a_save_keeps_the_last_checkpoint_and_names_the_error(runs):
    run = runs("disk-full", extra_args("disk-full@1", max_restarts=1))
    assert run.returncode not in (0, None)
    assert_failure_line(run, "File too large", "[deterministic]", resumable=False)
    assert ended_at(run) - fault_time(run, "disk-full@1") <= END_WITHIN_S + 30  # rollout 1 runs before its save
    assert_checkpoint_loads(run, 0)
    assert not (save_dir(run) / "rollout_000001").exists()


# -- d: the Ray head's GCS process dies --------------------------------------------------------------

def test_dead_gcs_is_restarted_once_and_ends_like_an_uninterrupted_run(runs, uninterrupted):
    killed = {}

    def kill_gcs_at_rollout_1(out: Path, token: str) -> None:
        wait_for_path(out / RUN_ID / "checkpoints" / "latest")
        for pid in token_pids(token):  # the run's processes; among them the one in the GCS role
            if _role(pid) == "gcs_server":
                os.kill(pid, signal.SIGKILL)
                killed["at"] = time.time()
                return

    run = runs("gcs", extra_args(max_restarts=1), during=kill_gcs_at_rollout_1)
    assert "at" in killed, run.report("no GCS process carried the run's token")
    assert run.ok, run.report()
    line = restart_line(run)
    assert "Ray head GCS (node " in line and "gcs_server process died" in line and "[infrastructure]" in line
    attempts = run.run_json["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2] and attempts[0]["kind"] == "infrastructure"
    assert run.run_json["resumed"] is True
    assert_same_as_uninterrupted(run, uninterrupted)


def _role(pid: int) -> str:
    """A Ray daemon's role: the basename of its executable (read only for processes carrying our token)."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""
    return Path(argv0).name


# -- issue 27: a run never confuses itself with another run's checkpoints --------------------------

def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_refused_before_training(run: RecipeRun, run_id: str, *words: str) -> str:
    """Exit 2, one error line naming `words`, no Ray head started, nothing of the run's but its record."""
    assert run.returncode == 2, run.report()
    log = run.log_path.read_text(errors="replace")
    errors = [l for l in log.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == last_line(run), run.report()
    assert "Traceback" not in log and "restart 1/" not in log and "Ray head up" not in log
    for word in words:
        assert word in errors[0], run.report(f"{word!r} missing from: {errors[0]}")
    written = sorted(p.name for p in (run.out_dir / run_id).iterdir()) if (run.out_dir / run_id).exists() else []
    assert all(name.startswith("refused-") for name in written), written
    assert not (run.out_dir / ".launcher").exists()  # no Ray node was started or recorded
    return errors[0]


def test_a_fresh_run_pointed_at_another_runs_save_dir_is_refused_and_leaves_it_byte_identical(runs, uninterrupted):
    theirs = save_dir(uninterrupted)
    before = _files(theirs)
    run = runs("intruder", ["--run-id", "intruder", "--extra-args", f"{EXTRA} --save {theirs}", "--max-restarts", "2"])
    assert_refused_before_training(run, "intruder", f"--save {theirs}", f"another run ({RUN_ID}", "fix: ")
    assert _files(theirs) == before
    print(f"refused in {run.wall_time:.2f}s (the launcher's wall time)")


def test_a_load_of_a_differently_configured_checkpoint_is_refused_and_leaves_it_byte_identical(runs, uninterrupted):
    theirs = save_dir(uninterrupted)
    before = _files(theirs)
    run = runs("other-config", ["--run-id", "other-config", "--extra-args", f"{EXTRA} --load {theirs} --lr 5e-4",
                                "--max-restarts", "2"])
    assert_refused_before_training(run, "other-config", f"--load {theirs}", "(checkpoint: ", "--lr 0.0005",
                                   "--load-anyway")
    assert _files(theirs) == before
    print(f"refused in {run.wall_time:.2f}s (the launcher's wall time)")


def test_a_checkpoint_without_its_vae_with_max_restarts_2_fails_once_in_one_line(runs, uninterrupted, tmp_path):
    import shutil

    from miles.proxy_assets import checkpoint_name
    from miles.launcher.recipe_assets import SEED

    broken = tmp_path / "sd3-without-vae"
    shutil.copytree(runs.model_dir / checkpoint_name("sd3", "tiny", SEED), broken)  # the one the suite's runs use
    shutil.rmtree(broken / "vae")
    run = runs("no-vae", ["--run-id", "no-vae", "--extra-args", f"{EXTRA} --hf-checkpoint {broken}",
                          "--max-restarts", "2"])
    assert_refused_before_training(run, "no-vae", f"--hf-checkpoint {broken}", "vae/", "fix: ")
    assert run.wall_time < 5, f"{run.wall_time:.1f}s"
    print(f"refused in {run.wall_time:.2f}s (the launcher's wall time)")


# -- a SIGKILL during a save leaves the previous checkpoint loadable, bit for bit -------------------

def test_sigkill_of_the_train_rank_during_a_save_leaves_the_previous_checkpoint_loadable_bit_exact(runs, uninterrupted):
    killed = {}

    def sigkill_the_saving_rank(out: Path, token: str) -> None:
        wait_for_path(out / RUN_ID / "checkpoints" / ".staging_rollout_000001")
        time.sleep(1.0)  # the save is being written (slow-save holds the background write 60 s)
        for pid in token_pids(token):
            if _proctitle(pid).startswith("ray::TrainActor"):
                os.kill(pid, signal.SIGKILL)
                killed["at"] = time.time()

    run = runs("sigkill-save", extra_args("slow-save@1"), during=sigkill_the_saving_rank)
    assert "at" in killed, run.report("no train rank was found inside the save")
    assert run.returncode not in (0, None)
    assert_checkpoint_loads(run, 0)
    assert not (save_dir(run) / "rollout_000001").exists()
    ours = _files(save_dir(run) / "rollout_000000")
    theirs = _files(save_dir(uninterrupted) / "rollout_000000")
    assert ours == theirs, "the checkpoint before the kill differs from the uninterrupted run's"


# -- a SIGKILL during a background save: training went on, the last commit loads and resumes -------

def test_sigkill_while_a_background_save_is_written_keeps_the_last_commit_and_resumes_exactly(runs, uninterrupted):
    seen = {}

    def sigkill_the_rank_once_the_next_rollout_trained(out: Path, token: str) -> None:
        checkpoints, metrics = out / RUN_ID / "checkpoints", out / RUN_ID / "metrics.jsonl"
        wait_for_path(checkpoints / ".staging_rollout_000001")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.05)  # rollout 2 trained and logged while rollout 1's save is written
        seen["latest"] = (checkpoints / "latest").read_text().strip()
        seen["staging"] = (checkpoints / ".staging_rollout_000001").is_dir()
        for pid in token_pids(token):
            if _proctitle(pid).startswith("ray::TrainActor"):
                os.kill(pid, signal.SIGKILL)
                seen["killed"] = time.time()

    run = runs("sigkill-background-save", extra_args("slow-save@1", max_restarts=1),
               during=sigkill_the_rank_once_the_next_rollout_trained)
    assert "killed" in seen, run.report("no train rank was found while the save was written")
    # the train step of rollout 2 ran while rollout 1's save was still uncommitted: off the critical path
    assert seen["latest"] == "rollout_000000" and seen["staging"], seen
    # the restarted attempt loaded the last commit (rollout 0) and ended bit for bit like an uninterrupted run
    assert_restarted_once(run, uninterrupted, "slow-save@1", "train rank 0", "ActorDiedError")


def _proctitle(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def test_a_normal_run_prints_neither_rays_address_line_nor_an_unneeded_open_files_warning(uninterrupted):
    import resource

    from miles.launcher.local_cluster import open_files_needed
    from miles.launcher.ray_cluster import RayNodeSpec, RayPorts, cpu_job_num_cpus

    log = uninterrupted.log_path.read_text(errors="replace")
    assert "Ray head up on" in log  # the launcher's own line says where the head is
    assert "set in the environment variable RAY_ADDRESS" not in log and "Using address" not in log
    head = RayNodeSpec("127.0.0.1", RayPorts(), "/tmp/mray-x", 0, cpu_job_num_cpus(0))  # the CPU recipe's head
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] >= open_files_needed(head):  # the limit covers it: no warning
        assert "open-files limit" not in log
