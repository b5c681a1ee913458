"""Submitting the training command as a Ray job and following it to its end.

Submitted through the SDK rather than `ray job submit` so that secrets in the runtime env never
appear on a command line (where `ps` and shell history would show them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pathlib import Path

from miles.launcher.env_vars import redact_env, redact_text

INTERRUPTED_EXIT_CODE = 130


@dataclass(frozen=True)
class JobRequest:
    address: str  # the job server: http://host:port
    entrypoint: str
    env_vars: Mapping[str, str]  # the job's whole environment as the launcher sets it
    submission_id: str
    # names that reach the job through the raylet's inherited environment instead of the
    # runtime env (which Ray's runtime-env agent writes, values included, to its log)
    inherited: frozenset[str] = frozenset()

    @property
    def runtime_env(self) -> dict:
        return {"env_vars": {k: v for k, v in self.env_vars.items() if k not in self.inherited}}

    def display_command(self) -> str:
        """The equivalent `ray job submit` line, secrets redacted: what the log and plan show."""
        runtime_env = json.dumps({"env_vars": redact_env(self.env_vars)}, sort_keys=True)
        return (
            f"ray job submit --address={shlex.quote(self.address)} "
            f"--runtime-env-json={shlex.quote(runtime_env)} -- {self.entrypoint}"
        )


class _JobOutput:
    """The job's output: to stdout and to the job log, secrets redacted; remembers the last lines."""

    def __init__(self, log_path: Path | None, secrets: list[str]):
        self.secrets = secrets
        self.log = open(log_path, "a") if log_path is not None else None
        self.log_path = log_path
        self.last_lines: list[str] = []
        self.streamed: list[str] = []  # as Ray sent it, before redaction: what the job's log file starts with

    def write_rest(self, whole_log: str) -> None:
        """Once the job has ended: what of its log file the stream had not delivered yet."""
        streamed = "".join(self.streamed)
        if whole_log.startswith(streamed):
            if len(whole_log) > len(streamed):
                self.write(whole_log[len(streamed):])
            return
        self.write("\n[the streamed output and the job's log file disagree; the whole log file follows]\n")
        self.write(whole_log)

    def write(self, chunk: str) -> None:
        self.streamed.append(chunk)
        chunk = redact_text(chunk, self.secrets)
        sys.stdout.write(chunk)
        sys.stdout.flush()
        if self.log is not None:
            self.log.write(chunk)
            self.log.flush()
        self.last_lines = (self.last_lines + chunk.splitlines())[-200:]

    def cause(self) -> str:
        """The job's own one-line reason, if it printed one (train_diffusion.py: error: ...)."""
        for line in reversed(self.last_lines):
            if "error:" in line.lower() or line.startswith(("ValueError", "RuntimeError", "FileNotFoundError")):
                return line.strip()
        return ""

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def submit_and_follow(request: JobRequest, log_path: Path | None = None, secrets: list[str] = (),
                      causes: list[str] | None = None) -> int:
    """Submit, stream the job's output to stdout (and `log_path`), return its exit status
    (non-zero on failure); after a failure the last line printed names the cause and the log,
    unless `causes` is given: then the job's own one-line reason is appended to it instead, for
    the caller's last line (the error prints once).

    Ctrl-C stops the job and returns 130.
    """
    from ray.job_submission import JobSubmissionClient

    from miles.launcher.ray_auth import headers_for

    # the cluster's token as a header (ray_auth): a token in ~/.ray or the shell never decides it
    client = JobSubmissionClient(request.address, headers=headers_for(request.address))
    job_id = submit_when_an_agent_is_up(client, request)
    output = _JobOutput(log_path, list(secrets))
    try:
        asyncio.run(_follow_until_ended(client, job_id, output))
        status = _exit_status(client, job_id)
        if status != 0 and causes is not None:
            causes.append(output.cause())
        elif status != 0:
            cause = output.cause() or "see the log above"
            where = f"; job log: {log_path}" if log_path is not None else ""
            print(f"error: the training job failed (exit {status}): {cause}{where}", file=sys.stderr, flush=True)
        return status
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopping Ray job {job_id}", file=sys.stderr, flush=True)
        _stop_quietly(client, job_id)
        return INTERRUPTED_EXIT_CODE
    finally:
        output.close()


# Ray's job server answers this while no node's job agent has registered yet: a head that just
# came up on a loaded machine (seen: a 2-core machine under a full test suite). No job is made, so
# the same submission id may be sent again.
_NO_AGENT_YET = "No available agent to submit job"


def submit_when_an_agent_is_up(client, request: JobRequest, wait_s: float = 120.0, poll_s: float = 1.0,
                               clock=time.monotonic, sleep=time.sleep) -> str:
    """`client.submit_job(...)`, sent again while the job server says it has no agent yet, for up
    to `wait_s`; any other refusal, or that one past the wait, is raised as it came."""
    deadline = clock() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=request.entrypoint, runtime_env=request.runtime_env,
                                     submission_id=request.submission_id)
        except RuntimeError as err:
            if _NO_AGENT_YET not in str(err) or clock() >= deadline:
                raise
        sleep(poll_s)


async def _follow_until_ended(client, job_id: str, output: _JobOutput, poll_s: float = 1.0) -> None:
    """Stream the job's output until the job has ended. Ray closes its log stream only after a
    1 s sleep past the status change (measured: 2.3 s after the job was already SUCCEEDED, on every
    run), so the status is polled beside the stream, and once it is final the rest of the log is
    read from the job's log file, which is complete when the driver process has exited.

    Once a second: each poll is an HTTP round trip through the dashboard and its job module, and at
    5 a second they cost about 1 CPU-s per run of a minute (measured on a 2-core machine)."""
    stream = asyncio.ensure_future(_stream_logs(client, job_id, output))
    while not stream.done():
        info = await asyncio.to_thread(client.get_job_info, job_id)
        if info.status.is_terminal():
            break
        await asyncio.wait({stream}, timeout=poll_s)
    if stream.done():
        stream.result()  # the stream's own error, if it failed
        return
    stream.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stream
    output.write_rest(await asyncio.to_thread(client.get_job_logs, job_id))


async def _stream_logs(client, job_id: str, output: _JobOutput) -> None:
    async for chunk in client.tail_job_logs(job_id):
        output.write(chunk)


def _exit_status(client, job_id: str, settle_s: float = 30.0) -> int:
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + settle_s
    info = client.get_job_info(job_id)
    while not info.status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)  # the log stream can close a moment before the status is final
        info = client.get_job_info(job_id)
    # Ray's failure message repeats the job's log, which was just streamed: keep its first line
    reason = (info.message or "").splitlines()[0] if info.message else ""
    print(f"Ray job {job_id} finished: {info.status}" + (f" ({reason})" if reason else ""), flush=True)
    if info.status == JobStatus.SUCCEEDED:
        return 0
    return info.driver_exit_code if info.driver_exit_code not in (None, 0) else 1


def _stop_quietly(client, job_id: str) -> None:
    try:
        client.stop_job(job_id)
    except Exception as err:  # the cluster may already be going down with the Ctrl-C
        print(f"could not stop job {job_id}: {err}", file=sys.stderr)
