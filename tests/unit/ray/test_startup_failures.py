"""Start-up failures: an actor whose constructor raises, and a layout the cluster cannot place.

The classification and the failure line without Ray first; then the driver's own waits on the
worker's 2-CPU Ray cluster (tests/unit/conftest.py): a constructor that raises ends a wait on
something else at once, and a placement group is refused at once or waited for with progress
lines up to its timeout. The whole runs are in tests/e2e/test_startup_faults.py (`-m faults`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from miles.ray import faults
from miles.flags import debug_faults
from miles.launcher import restarts

# Ray 2.x's message for a constructor that raised, as `str(err)` of the ActorDiedError shows it
RAY_CREATION_TEXT = """The actor died because of an error raised in its creation task, \x1b[36mray::RolloutEngineActor.__init__()\x1b[39m (pid=13833, ip=10.0.0.7, actor_id=0aa8ba664a9e8263ff842e1501000000, repr=<RolloutEngineActor>)
  File "/repo/miles/rollout/engine.py", line 30, in __init__
    self.pipe = load_pipeline(checkpoint, family)
  File "/repo/miles/models/loader.py", line 291, in check_checkpoint_dir
    raise CheckpointError(f"checkpoint directory {path} does not exist")
miles.models.loader.CheckpointError: checkpoint directory /models/stable-diffusion-3.5-medium does not exist"""


class _CreationError(Exception):
    """Stands for Ray's ActorDiedError of a creation task: its text and its init flag."""

    def __init__(self, text: str):
        super().__init__(text)
        self.error_msg, self._actor_init_failed = text, True


def test_the_root_cause_of_an_actor_traceback_is_its_last_exception_line():
    assert faults.root_cause(RAY_CREATION_TEXT) == (
        "CheckpointError",
        "miles.models.loader.CheckpointError: checkpoint directory /models/stable-diffusion-3.5-medium does not exist")
    assert faults.root_cause("Traceback:\n  File x\nKeyError")[0] == "KeyError"


def test_a_constructor_that_raised_is_deterministic_unless_its_cause_is_the_machine():
    assert faults.creation_kind("CheckpointError") == faults.DETERMINISTIC
    assert faults.creation_kind("FileNotFoundError") == faults.DETERMINISTIC
    assert faults.creation_kind("ConnectionResetError") == faults.INFRASTRUCTURE


def test_a_creation_failure_names_role_rank_node_pid_and_the_root_cause_not_the_traceback():
    failure = faults.actor_failure(_CreationError(RAY_CREATION_TEXT), faults.Member("rollout engine", 1), "reward start")
    assert failure.line() == (
        "rollout engine 1 (node 10.0.0.7, pid 13833) failed during start: miles.models.loader.CheckpointError: "
        "checkpoint directory /models/stable-diffusion-3.5-medium does not exist [deterministic]")
    assert "loader.py\", line 291" in failure.detail  # the traceback goes to the job log, not the line


def _save_with_checkpoint(tmp_path: Path) -> Path:
    save = tmp_path / "ckpt"
    (save / "rollout_000000").mkdir(parents=True)
    (save / "rollout_000000" / "trainer.json").write_text(json.dumps({"rollout_id": 0}))
    (save / "latest").write_text("rollout_000000\n")
    return save


def test_the_resume_hint_appears_only_where_a_checkpoint_exists_and_the_cause_is_not_deterministic(tmp_path):
    det = restarts.Attempt(1, exit=1, cause="rollout engine 0 (...) failed during start: CheckpointError: x "
                                            "[deterministic]", kind="deterministic")
    infra = restarts.Attempt(1, exit=1, cause="train rank 0 (...) failed: ActorDiedError [infrastructure]",
                             kind="infrastructure")
    empty, save = str(tmp_path / "none"), str(_save_with_checkpoint(tmp_path))
    assert "resume" not in restarts.failure_line(det, empty, "python3 r.py", Path("job.log"))
    assert "resume" not in restarts.failure_line(infra, empty, "python3 r.py", Path("job.log"))
    assert "; resume: python3 r.py;" in restarts.failure_line(infra, save, "python3 r.py", Path("job.log"))
    deterministic = restarts.failure_line(det, save, "python3 r.py", Path("job.log"))
    assert "resume: " not in deterministic and "not resumable as is" in deterministic
    assert not restarts.restartable(det) and restarts.restartable(infra)  # --max-restarts never repeats a bad input


def test_start_up_faults_strike_before_rollout_0_once_per_run_dir(tmp_path):
    with pytest.raises(ValueError, match="use engine-init@0"):
        debug_faults.parse_fault("engine-init@2")
    args = type("A", (), {"debug_fault": "train-setup@0", "run_dir": str(tmp_path)})()
    assert debug_faults.missing_checkpoint(args, "engine-init") is None  # another kind
    broken = debug_faults.missing_checkpoint(args, "train-setup")
    assert broken is not None and not Path(broken).exists()
    assert debug_faults.missing_checkpoint(args, "train-setup") is None  # a restarted attempt starts cleanly


# -- with Ray --------------------------------------------------------------------------------------

def _actor_classes():
    """Defined here, so Ray ships them by value (a worker cannot import this test module)."""

    class RaisesInInit:
        def __init__(self, delay: float, stamp: str):
            time.sleep(delay)
            from miles.models.loader import CheckpointError

            Path(stamp).write_text(repr(time.time()))  # the same host: the test reads this clock
            raise CheckpointError("checkpoint directory /nowhere does not exist")

    class Slow:
        def wait(self, seconds: float) -> int:
            time.sleep(seconds)
            return 1

    return RaisesInInit, Slow


def test_a_constructor_that_raises_ends_a_wait_on_another_actor_at_once(local_ray, tmp_path):
    ray = local_ray
    faults.WATCH.clear()
    raises_in_init, slow_class = _actor_classes()
    stamp = tmp_path / "raised_at"
    broken = ray.remote(raises_in_init).options(num_cpus=0.1).remote(0.5, str(stamp))
    faults.watch_creation([broken], "rollout engine")
    slow = ray.remote(slow_class).options(num_cpus=0.1).remote()
    with pytest.raises(faults.RunFailure) as caught:
        faults.wait_for([slow.wait.remote(600)], [slow], "reward start",
                        deadlines=faults.Deadlines(first_s=900))
    ended = time.time()
    ray.kill(slow)
    # Timed from the raise, not from the wait's start: on a loaded CI machine a worker process
    # takes up to ~40 s to start (the e2e start-up tables), which is not the wait's fault. The
    # wait is event-driven (ray.wait on the watched creation ref), so what is left is Ray's
    # propagation of a dead actor, seconds at most; 30 s stays far below the 600 s call and the
    # 900 s deadline a wait that ignored the constructor would run into.
    after_raise = ended - float(stamp.read_text())
    assert after_raise < 30, f"the wait went on {after_raise:.1f}s after the constructor raised"
    failure = caught.value
    assert (failure.role, failure.rank, failure.kind, failure.what) == ("rollout engine", 0, "deterministic", "start")
    assert "CheckpointError: checkpoint directory /nowhere does not exist" in failure.line()
    assert failure.node and failure.pid
    assert not faults.WATCH.pending


def _plan(bundles):
    from miles.ray.placement import PlacementPlan

    return PlacementPlan(bundles, [])


def test_a_placement_no_node_can_hold_is_refused_at_once_naming_request_and_offer(local_ray):
    from miles.ray.placement import create_placement_group
    from miles.plan.resource_fit import Request

    plan = _plan([{"GPU": 1.0, "CPU": 1.0}] * 2)
    began = time.monotonic()
    with pytest.raises(faults.PlacementFailure) as caught:
        create_placement_group(plan, [Request("2 train ranks", plan.bundles)], timeout_s=600)
    assert time.monotonic() - began < 5
    line = caught.value.line()
    assert line.startswith("placement (head node ") and line.endswith("[deterministic]")
    assert "2 train ranks asks for {GPU: 1, CPU: 1} on one node" in line and "{CPU: 2" in line, line
    assert not [pg for pg in local_ray.util.placement_group_table().values() if pg["state"] == "PENDING"]


def test_a_busy_placement_is_waited_for_with_progress_lines_naming_the_holder_then_ends_at_its_timeout(local_ray):
    from ray.util.placement_group import placement_group, remove_placement_group

    from miles.ray.placement import create_placement_group

    holder = placement_group([{"CPU": 2.0}], name="someone-else")
    local_ray.get(holder.ready(), timeout=60)
    lines: list[str] = []
    try:
        with pytest.raises(faults.PlacementFailure) as caught:
            create_placement_group(_plan([{"CPU": 1.0}]), timeout_s=2.5, progress_every_s=1.0,
                                   say=lambda line, **_: lines.append(line))
    finally:
        remove_placement_group(holder)
    assert lines and all(line.startswith("placement: waiting ") for line in lines)
    assert "held by: placement group" in lines[0] and "someone-else {CPU: 2}" in lines[0], lines[0]
    failure = caught.value
    assert failure.kind == "infrastructure" and "not placed within --placement-timeout-s 2.5" in failure.line()


def test_placement_timeout_s_ends_the_drivers_wait_for_a_busy_cluster(local_ray, tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group

    from miles.ray.placement import place_run
    from miles.flags.arguments import parse_args

    args = parse_args(["--hf-checkpoint", "x", "--diffusion-model-family", "sd3", "--prompt-data", "p.jsonl",
                       "--rm-type", "brightness", "--num-rollout", "1", "--device", "cpu",
                       "--actor-num-gpus-per-node", "1", "--placement-timeout-s", "2"])
    holder = placement_group([{"CPU": 2.0}])
    local_ray.get(holder.ready(), timeout=60)
    began = time.monotonic()
    try:
        with pytest.raises(faults.PlacementFailure, match=r"not placed within --placement-timeout-s 2:"):
            place_run(args, say=lambda *a, **k: None)
    finally:
        remove_placement_group(holder)
    assert 2 <= time.monotonic() - began < 15


def test_an_exception_raised_before_the_roster_located_the_actor_is_placed_by_rays_error_text():
    class Raised(Exception):  # stands for Ray's RayTaskError of a method (here: the set-up)
        pass

    err = Raised("ray::TrainActor.setup_at() (pid=4242, ip=10.0.0.9, actor_id=ab, repr=<x>)\n  File ...\n"
                 "CheckpointError: checkpoint directory /x does not exist")
    actor = type("Handle", (), {"_actor_id": type("Id", (), {"hex": lambda self: "feed"})()})()
    faults.ROSTER.members["feed"] = faults.Member("train rank", 1)
    try:
        tagged = faults._failure_of(err, actor, "setup")
    finally:
        del faults.ROSTER.members["feed"]
    failure = faults.classify(tagged)
    assert failure.line().startswith("train rank 1 (node 10.0.0.9, pid 4242) failed during setup: ")
