"""SIGKILL a run's process group after a checkpoint, resume with --load: same weights, same metrics,
the data order restored from the checkpoint (said in one line), the same wandb run continued; the
uninterrupted run keeps only its newest checkpoint (--keep-last 1).

Two rollouts, a checkpoint after each, are enough: the kill lands after rollout 0's checkpoint and
before rollout 1's (which ends the run). A tiny rollout takes under a second and both saves run in
the background, so a kill timed off rollout 0's checkpoint alone can land after the run has ended;
`--debug-fault slow-save@1` holds rollout 1's save open for 60 s instead, which pins the kill
between the two checkpoints on any machine (the fault fires once per run dir, so the resumed attempt
saves at full speed). Then the resumed attempt loads rollout 0 (weights, AdamW
moments after one step, data order) and its one step must land on the uninterrupted run's bits;
a state the checkpoint lost or the load skipped shows in rollout 1's metrics or final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safetensors.torch import load_file

from miles.backends.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[3]
FLAGS = "--num-rollout 2 --save-interval 1 --deterministic-mode --actor-num-gpus-per-node 1 --num-gpus-per-node 1 --colocate"


def launch(argv: list[str], gcs_address: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": gcs_address, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / "train_diffusion.py"), *argv], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]


@pytest.mark.slow  # the README's command proves a bit-exact resume one level down: tests/unit/backends/test_fsdp.py
def test_killed_run_resumes_at_the_next_rollout_and_ends_like_an_uninterrupted_one(ray_cluster, tiny_argv, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    import train_diffusion

    # the uninterrupted run needs no process of its own (nothing kills it): in this one, as
    # test_train_loop.py runs them, without a second driver's imports
    assert train_diffusion.main(tiny_argv(whole, f"{FLAGS} --save {whole}/ckpt --keep-last 1")) == 0
    assert sorted(p.name for p in (whole / "ckpt").iterdir()) == ["latest", "rollout_000001"]

    argv = tiny_argv(killed, f"{FLAGS} --save {killed}/ckpt --use-wandb --wandb-mode offline --debug-fault slow-save@1")
    proc = launch(argv, ray_cluster, tmp_path / "first.log")
    deadline = time.monotonic() + 900
    while latest_checkpoint(killed / "ckpt") is None:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_after = latest_checkpoint(killed / "ckpt")[0]
    assert killed_after < 1, "the run finished before it could be killed; nothing was tested"

    finish(launch(argv + ["--load", f"{killed}/ckpt"], ray_cluster, tmp_path / "second.log"), tmp_path / "second.log")

    run = json.loads((killed / "run.json").read_text())
    assert run["resumed"] is True and run["start_rollout_id"] == killed_after + 1
    record = json.loads((latest_checkpoint(killed / "ckpt")[1] / "trainer.json").read_text())
    assert record["run_id"] == "killed" and record["training_flags"]["lr"] and record["code_version"]
    assert run["loaded_from"]["run_id"] == "killed" and run["loaded_from"]["flag_differences"] == []
    order = f"data order: restored from rollout_{killed_after:06d}: seed "
    assert sum(order in line for line in (tmp_path / "second.log").read_text().splitlines()) == 1
    # one wandb run across the kill: the resumed attempt continued the id the checkpoint recorded
    wandb_runs = {p.name.rsplit("-", 1)[-1] for p in (killed / "wandb").glob("offline-run-*")}
    assert record["wandb_run_id"] and wandb_runs == {record["wandb_run_id"]}
    assert (killed / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    final = latest_checkpoint(killed / "ckpt")
    assert final[0] == 1 and latest_checkpoint(whole / "ckpt")[0] == 1
    ours = load_file(str(final[1] / "model_transformer.safetensors"))
    theirs = load_file(str(latest_checkpoint(whole / "ckpt")[1] / "model_transformer.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all((ours[k] == theirs[k]).all() for k in ours)
