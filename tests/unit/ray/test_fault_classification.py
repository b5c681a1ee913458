"""Fault handling without a cluster: deadlines, the failure line, restart decisions, the resume
command, and refusing another run's checkpoints. The real faults are in tests/e2e/test_faults.py
(`pytest tests/e2e -m faults`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from miles.ray import faults
from miles.flags import debug_faults
from miles.flags.arguments import parse_args
from miles.launcher import restarts


def _args(*extra: str) -> argparse.Namespace:
    return parse_args(["--hf-checkpoint", "x", "--diffusion-model-family", "sd3", "--prompt-data", "p.jsonl", "--rm-type", "brightness",
                       "--num-rollout", "2", *extra])


def test_remote_deadlines_start_at_the_first_timeout_then_scale_with_the_slowest_call():
    d = faults.Deadlines.from_args(_args("--remote-timeout-s", "900", "--remote-timeout-factor", "4",
                                         "--remote-timeout-min-s", "30"))
    assert d.timeout("train") == 900  # not measured yet: actor start, the first rollout
    d.measured("train", 2.0)
    assert d.timeout("train") == 30  # 4 x 2 s is under the floor
    d.measured("train", 20.0)
    d.measured("train", 5.0)
    assert d.timeout("train") == 80  # 4 x the slowest so far
    assert d.timeout("score") == 900
    assert "--remote-timeout-factor 4" in d.explain("train")


def test_default_deadlines_are_generous():
    d = faults.Deadlines.from_args(_args())
    assert (d.first_s, d.factor, d.min_s) == (1800.0, 10.0, 120.0)


def test_debug_fault_is_checked_at_parse_time(capsys):
    assert _args("--debug-fault", "nan@2").debug_fault == "nan@2"
    with pytest.raises(SystemExit):
        _args("--debug-fault", "oom@2")
    assert "expected KIND@ROLLOUT" in capsys.readouterr().err


def test_a_fault_fires_once_per_run_dir(tmp_path):
    args = argparse.Namespace(debug_fault="engine-kill@1", run_dir=str(tmp_path))
    assert not debug_faults.fault_due(args, "engine-kill", 0)
    assert debug_faults.fault_due(args, "engine-kill", 1)
    assert not debug_faults.fault_due(args, "engine-kill", 1)  # a restarted attempt does not fire it again


def test_failure_line_names_role_rank_node_pid_cause_and_kind(tmp_path):
    f = faults.RunFailure("train rank", 1, "10.0.0.2", "ActorDiedError: its worker process died", faults.INFRASTRUCTURE,
                          pid=4242, what="train", rollout_id=7)
    assert f.line() == ("train rank 1 (node 10.0.0.2, pid 4242) failed during train at rollout 7: "
                        "ActorDiedError: its worker process died [infrastructure]")
    faults.write_failure(tmp_path, f, (6, tmp_path / "ckpt" / "rollout_000006"))
    record = faults.read_failure(tmp_path)
    assert record["kind"] == "infrastructure" and record["checkpoint_rollout_id"] == 6 and record["line"] == f.line()


def test_non_finite_loss_is_a_deterministic_failure():
    faults.check_finite({"train/loss": 0.5, "train/grad_norm": 1.0}, 3)
    with pytest.raises(faults.NonFiniteError) as info:
        faults.check_finite({"train/loss": float("nan"), "train/grad_norm": 1.0}, 3)
    assert info.value.kind == faults.DETERMINISTIC and "train/loss=nan" in info.value.line()


def test_an_exception_of_ours_is_deterministic():
    f = faults.classify(ValueError("bad prompt file"))
    assert f.kind == faults.DETERMINISTIC and f.cause_text == "ValueError: bad prompt file"


def test_only_infrastructure_failures_are_restarted():
    assert restarts.restartable(restarts.Attempt(1, kind="infrastructure"))
    for kind in ("deterministic", "interrupted", None):
        assert not restarts.restartable(restarts.Attempt(1, kind=kind))


def test_resume_command_keeps_the_options_and_adds_run_id_and_load():
    argv = ["scripts/run_x.py", "--num-rollout", "3", "--run-id", "old", "--extra-args", "--lr 1e-3",
            "--max-restarts", "2"]
    cmd = restarts.resume_command("r1", "--lr 1e-3", "/out/r1/checkpoints", argv)
    assert cmd == ("python3 scripts/run_x.py --num-rollout 3 --run-id r1 "
                   "--extra-args '--lr 1e-3 --load /out/r1/checkpoints'")


def test_failure_line_names_the_last_committed_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    (save / "rollout_000002").mkdir(parents=True)
    (save / "rollout_000002" / "trainer.json").write_text(json.dumps({"rollout_id": 2}))
    (save / "latest").write_text("rollout_000002\n")
    attempt = restarts.Attempt(1, exit=1, cause="reward worker 0 (node n, pid 1) failed: x [infrastructure]",
                               kind="infrastructure")
    line = restarts.failure_line(attempt, str(save), "python3 r.py", Path("job.log"))
    assert line == (f"error: the training job failed (exit 1): reward worker 0 (node n, pid 1) failed: x "
                    f"[infrastructure]; last committed checkpoint {save}/rollout_000002 (rollout 2); "
                    f"resume: python3 r.py; job log: job.log")


def test_attempts_are_recorded_in_run_json(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"resumed": True}))
    restarts.add_attempts_to_run_json(tmp_path, [
        restarts.Attempt(1, exit=1, cause="c", kind="infrastructure"),
        restarts.Attempt(2, load="/ck", resumed_from_rollout=3, exit=0)])
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["restarts"] == 1 and record["resumed"] is True
    assert [(a["attempt"], a["resumed_from_rollout"], a["kind"]) for a in record["attempts"]] == [
        (1, None, "infrastructure"), (2, 3, None)]


def test_a_fresh_run_refuses_a_save_dir_holding_another_runs_checkpoints(tmp_path):
    import train_diffusion

    save = tmp_path / "ckpt"
    (save / "rollout_000004").mkdir(parents=True)
    (save / "rollout_000004" / "trainer.json").write_text(json.dumps({"rollout_id": 4, "run_id": "r"}))
    (save / "latest").write_text("rollout_000004\n")
    run = dict(run_dir=str(tmp_path / "r"), load_anyway=False)
    with pytest.raises(ValueError, match=r"already holds committed checkpoints .* add --load"):
        train_diffusion.refuse_foreign_checkpoints(argparse.Namespace(save=str(save), load=None, **run))
    with pytest.raises(ValueError, match=r"holds checkpoints of another run \(r: "):
        train_diffusion.refuse_foreign_checkpoints(argparse.Namespace(save=str(save), load=str(save),
                                                                      **{**run, "run_dir": str(tmp_path / "s")}))
    train_diffusion.refuse_foreign_checkpoints(argparse.Namespace(save=str(tmp_path / "new"), load=None, **run))
