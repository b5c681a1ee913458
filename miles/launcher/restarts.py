"""What the launcher does after a failed job: one line saying who failed and how to resume, and
(with --max-restarts) relaunching the same run from its last committed checkpoint.

The trainer leaves `<run_dir>/failure.json` (miles.ray.faults): role, rank, node, pid, cause, kind
(`infrastructure` or `deterministic`) and the last committed checkpoint. Only infrastructure
failures are restarted. Each attempt is recorded in run.json under `attempts`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

FAILURE_FILE = "failure.json"  # miles.ray.faults.FAILURE_FILE (not imported: it would not matter, but keep this light)
INFRASTRUCTURE = "infrastructure"


@dataclass
class Attempt:
    attempt: int
    load: str | None = None  # the checkpoint directory given as --load (None: fresh)
    resumed_from_rollout: int | None = None  # first rollout of this attempt when resumed
    exit: int | None = None
    cause: str | None = None
    kind: str | None = None
    failure: dict | None = field(default=None, repr=False)
    started_at: float = field(default_factory=time.time)

    def record(self) -> dict:
        return {"attempt": self.attempt, "load": self.load, "resumed_from_rollout": self.resumed_from_rollout,
                "exit": self.exit, "cause": self.cause, "kind": self.kind,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.started_at))}


def read_failure(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / FAILURE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def set_aside_failure(run_dir: Path, attempt: int) -> None:
    """Before a new attempt: the previous attempt's failure.json must not be read as this one's."""
    path = run_dir / FAILURE_FILE
    if path.exists():
        os.replace(path, run_dir / f"failure.attempt{attempt}.json")


def latest_checkpoint(save: str | None) -> tuple[int, str] | None:
    """(rollout id, path) of the newest committed checkpoint, read without torch."""
    if not save:
        return None
    pointer = Path(save) / "latest"
    try:
        path = Path(save) / pointer.read_text().strip()
        meta = json.loads((path / "trainer.json").read_text())
        return int(meta["rollout_id"]), str(path)
    except (OSError, ValueError, KeyError):
        return None


def resume_command(run_id: str, extra_args: str, save: str | None, argv: list[str] | None = None) -> str:
    """The recipe's own command line with --run-id and --extra-args '... --load <save>'."""
    argv = list(sys.argv if argv is None else argv)
    script, rest = argv[0], argv[1:]
    kept, skip = [], False
    for word in rest:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in ("--run-id", "--extra-args", "--max-restarts"):
            skip = "=" not in word
            continue
        kept.append(word)
    extra = (extra_args or "").strip()
    if save and "--load" not in shlex.split(extra):
        extra = f"{extra} --load {save}".strip()
    cmd = ["python3", _relative(script), *kept, "--run-id", run_id]
    if extra:
        cmd += ["--extra-args", extra]
    return shlex.join(cmd)


def _relative(script: str) -> str:
    try:
        return str(Path(script).resolve().relative_to(Path.cwd()))
    except ValueError:
        return script


def restartable(attempt: Attempt) -> bool:
    return attempt.kind == INFRASTRUCTURE


DETERMINISTIC = "deterministic"


def failure_line(attempt: Attempt, save: str | None, resume: str, job_log: Path, *, gave_up: str = "") -> str:
    """The launcher's last line after a failure. The resume command only where a committed
    checkpoint exists and the cause is not deterministic: after a bad input or data, a NaN or a
    full disk, resuming would fail the same way, so the line names the cause to fix instead."""
    cause = attempt.cause or f"the training job exited with status {attempt.exit} (no failure record: see the job log)"
    kind = f" [{attempt.kind}]" if attempt.kind and f"[{attempt.kind}]" not in cause else ""
    found = latest_checkpoint(save)
    ckpt = (f"last committed checkpoint {found[1]} (rollout {found[0]})" if found
            else "no committed checkpoint" + ("" if save else " (no --save)"))
    if not found:
        hint = ""
    elif attempt.kind == DETERMINISTIC:
        hint = "not resumable as is: the cause repeats on every try, fix it first; "
    else:
        hint = f"resume: {resume}; "
    return f"error: the training job failed (exit {attempt.exit}): {cause}{kind}{gave_up}; {ckpt}; {hint}job log: {job_log}"


def add_attempts_to_run_json(run_dir: Path, attempts: list[Attempt]) -> None:
    path = run_dir / "run.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        record = {}
    record["attempts"] = [a.record() for a in attempts]
    record["restarts"] = len(attempts) - 1
    tmp = path.with_name(f".run.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


class HeadWatch:
    """Polls the head's GCS port while a job runs. When it stops answering (the GCS process died),
    `on_lost` runs (the launcher ends its node, which ends the job's log stream) and `cause` says
    what happened. Without it a dead GCS leaves the launcher waiting on a job server that no
    longer knows its job."""

    def __init__(self, gcs_address: str, on_lost, *, poll_s: float = 1.0, misses: int = 3):
        import threading

        self.gcs_address, self.on_lost, self.poll_s, self.misses = gcs_address, on_lost, poll_s, misses
        self.cause: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gcs-watch", daemon=True)

    def __enter__(self) -> "HeadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        from miles.launcher.ray_cluster import split_host_port, tcp_reachable

        host, port = split_host_port(self.gcs_address)
        missed = 0
        while not self._stop.wait(self.poll_s):
            missed = 0 if tcp_reachable(host, port, timeout=1.0) else missed + 1
            if missed >= self.misses:
                self.cause = (f"Ray head GCS (node {host}, port {port}) stopped answering for {self.misses * self.poll_s:.0f}s: "
                              f"the gcs_server process died; the job cannot continue [{INFRASTRUCTURE}]")
                print(f"error: {self.cause}; ending this attempt's Ray node", file=sys.stderr, flush=True)
                try:
                    self.on_lost()
                finally:
                    return
