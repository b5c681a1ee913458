"""Running a planned launch: start our Ray head (or reach the external cluster), submit the job once
the cluster holds the planned layout (a before_ray_job_submit hook told `ClusterInfo` first),
follow it, restart it as the flags allow, and end with one results line; SIGTERM ends it as an
interrupt. `execute_train` (train_launch) calls `_run_launch` with its plan."""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.records import phases
from miles.launcher import restarts
from miles.launcher.config import ExecuteTrainConfig
from miles.launcher.env_vars import master_addr, redact_text
from miles.launcher.flags import flag_values
from miles.launcher.job_submit import INTERRUPTED_EXIT_CODE, submit_and_follow
from miles.launcher.launch_mode import LaunchModeError, check_reachable
from miles.launcher import ray_auth
from miles.launcher.local_cluster import HEAD_ROLE, end_recorded_run, start_node, stop_node
from miles.launcher.processes import LaunchRecord, print_exec
from miles.launcher.ray_cluster import wait_for_cluster_resources
from miles.launcher.launch_errors import LaunchError
from miles.launcher.launch_planning import _Launch, _head_spec, _refuse_layout_the_cluster_cannot_hold


LAUNCHER_LOG = "launcher.log"  # Ray's start-up output and the launcher's own tracebacks
JOB_LOG = "job.log"  # the job's whole output, secrets redacted


@dataclass(frozen=True)
class ClusterInfo:
    """What a before_ray_job_submit hook is told about the cluster the job is about to go to."""

    job_server_url: str
    gcs_address: str | None  # None for an external cluster
    run_dir: str


def _run_launch(
    launch: _Launch, config: ExecuteTrainConfig, hook: Callable[..., Any] | None, cluster_wait_timeout: float
) -> int:
    """Returns the job's exit status; the head this started is ended whatever happens. The last
    line printed says where the results are, or what failed and where its log is."""
    run_dir = Path(launch.plan.run_dir)
    launcher_log = run_dir / LAUNCHER_LOG
    record = None
    status = 1
    save = flag_values(launch.plan.argv).get("--save")
    load = flag_values(launch.plan.argv).get("--load")
    found = restarts.latest_checkpoint(load)
    attempts = [restarts.Attempt(1, load=load, resumed_from_rollout=found[0] + 1 if found else None)]
    try:
        with _sigterm_as_interrupt():
            while True:
                if launch.node is None:
                    mode = check_reachable(launch.job.address, launch.plan.ray.get("address_from", "RAY_ADDRESS"))
                    launch.auth = ray_auth.external_auth(launch.job.address, mode)
                else:
                    if len(attempts) == 1:
                        end_recorded_run(config.output_dir, HEAD_ROLE)
                    record = LaunchRecord(HEAD_ROLE, launch.token, ray_temp_dir=launch.node.temp_dir,
                                          auth_token_file=launch.auth.token_file)
                    phases.mark("ray_head_start")
                    start_node(launch.node, record, config.output_dir, config.cuda_visible_devices,
                               launch.node_secrets, log_path=launcher_log, gpu_node=launch.device != "cpu",
                               auth=launch.auth)
                    ray_auth.remember(launch.node.job_server_url, launch.auth)
                    phases.mark("ray_head_ready")
                    print(f"Ray head up on {launch.node.node_ip}: job server {launch.node.job_server_url}, GCS "
                          f"{launch.node.gcs_address}; Ray's own output is in {launcher_log}", flush=True)
                    if config.num_nodes > 1:
                        print(ray_auth.how_nodes_join(launch.auth, launch.node.gcs_address), flush=True)
                restarts.set_aside_failure(run_dir, len(attempts) - 1)
                job_causes: list[str] = []
                watch = _watch_head(launch, record)
                try:
                    with watch:
                        status = _submit_when_ready(launch, config, hook, cluster_wait_timeout, job_causes)
                except Exception:
                    if watch.cause is None:
                        raise
                    _append_traceback(launcher_log, launch.secrets)
                    status = 1
                phases.mark("job_end", status=status)
                attempt = attempts[-1]
                attempt.exit, attempt.failure = status, restarts.read_failure(run_dir)
                if watch.cause is not None and status != 0:
                    attempt.cause, attempt.kind = watch.cause, restarts.INFRASTRUCTURE
                elif attempt.failure:
                    attempt.cause, attempt.kind = attempt.failure.get("line"), attempt.failure.get("kind")
                elif status == INTERRUPTED_EXIT_CODE:
                    attempt.cause, attempt.kind = _interrupted_cause(), "interrupted"
                elif job_causes and job_causes[-1]:
                    attempt.cause = job_causes[-1]
                if status == 0 or not restarts.restartable(attempt) or len(attempts) > config.max_restarts:
                    break
                launch, record = _restart(launch, record, config, attempts, save)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        status = INTERRUPTED_EXIT_CODE
        attempts[-1].exit = status
        attempts[-1].cause = _interrupted_cause()
        attempts[-1].kind = "interrupted"
    except (LaunchModeError, LaunchError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        status = 2
    except subprocess.CalledProcessError as err:
        print(f"error: command failed with status {err.returncode}: {redact_text(str(err.cmd), launch.secrets)}; "
              f"its output: {launcher_log}", file=sys.stderr, flush=True)
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
    except Exception as err:  # Ray's client and friends: the traceback to the log, one line here
        _append_traceback(launcher_log, launch.secrets)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"error: {type(err).__name__}: {redact_text(first, launch.secrets)}; traceback in {launcher_log}",
              file=sys.stderr, flush=True)
    finally:
        if record is not None:
            stop_node(record, succeeded=status == 0, keep_logs=config.keep_ray_logs)
        ray_auth.forget(launch.job.address)
        phases.mark("teardown_end")
    job_ran = attempts[-1].exit is not None  # a job ended or was stopped (not a launch error before it)
    if job_ran:
        try:
            restarts.add_attempts_to_run_json(run_dir, attempts)
        except OSError:
            pass
    if status == 0:
        print(_results_line(launch), flush=True)
    elif job_ran:
        gave_up = (f" (gave up after {len(attempts) - 1} restart(s), --max-restarts {config.max_restarts})"
                   if restarts.restartable(attempts[-1]) and config.max_restarts else "")
        resume = restarts.resume_command(config.run_id, config.extra_args, save)
        print(redact_text(restarts.failure_line(attempts[-1], save, resume, run_dir / JOB_LOG, gave_up=gave_up),
                          launch.secrets), file=sys.stderr, flush=True)
    return status


def _watch_head(launch: _Launch, record: LaunchRecord | None):
    """A GCS watch for a head of our own (a no-op context for an external cluster)."""
    import contextlib

    if launch.node is None:
        watch = contextlib.nullcontext()
        watch.cause = None
        return watch
    from miles.launcher.processes import end_token_processes

    session = record.session if record is not None else None
    return restarts.HeadWatch(launch.node.gcs_address,
                              lambda: end_token_processes(launch.token, session=session))


def _restart(launch: _Launch, record: LaunchRecord | None, config: ExecuteTrainConfig,
             attempts: list[restarts.Attempt], save: str | None) -> tuple[_Launch, LaunchRecord | None]:
    """End this attempt's cluster and prepare the next: a fresh head (external: the same cluster)
    and the same train argv with --load <save> from the last committed checkpoint."""
    previous = attempts[-1]
    found = restarts.latest_checkpoint(save)
    n = len(attempts) + 1
    print(f"restart {n - 1}/{config.max_restarts}: {previous.cause}; relaunching run {config.run_id} "
          + (f"from {found[1]} (rollout {found[0]}, resuming at {found[0] + 1})" if found
             else "from the start (no committed checkpoint)"), file=sys.stderr, flush=True)
    if record is not None:
        stop_node(record, keep_logs=config.keep_ray_logs)
    argv = list(launch.plan.argv) + (["--load", save] if found else [])
    attempts.append(restarts.Attempt(n, load=save if found else None,
                                     resumed_from_rollout=found[0] + 1 if found else None))
    node = launch.node
    if node is not None:
        node = _head_spec(launch.token, launch.plan.num_gpus_per_node, False, launch.head_port,
                          config.cuda_visible_devices)
    entry = shlex.split(launch.job.entrypoint)[:2] + argv
    job = dataclasses.replace(launch.job, address=node.job_server_url if node is not None else launch.job.address,
                              entrypoint=shlex.join(entry), submission_id=f"{launch.job.submission_id}-a{n}")
    plan = dataclasses.replace(launch.plan, argv=argv)
    return dataclasses.replace(launch, plan=plan, job=job, node=node), None


def _append_traceback(path: Path, secrets: list[str]) -> None:
    import traceback

    try:
        with open(path, "a") as fh:
            fh.write(redact_text(traceback.format_exc(), secrets))
    except OSError:
        pass


def _results_line(launch: _Launch) -> str:
    run_dir = Path(launch.plan.run_dir)
    save = flag_values(launch.plan.argv).get("--save")
    parts = [f"results: run dir {run_dir}", f"curves {run_dir / 'curves.png'}", f"samples {run_dir / 'last_rollout.png'}",
             f"checkpoint {save}" if save else "checkpoint none (no --save)"]
    after = f"next: python3 -m miles.export {run_dir} --out DIR" if save else "no checkpoint to export"
    return "; ".join(parts + _parity_summary(run_dir)) + f"\ndone in {phases.seconds_since_process_start():.0f} s; {after}"


def _parity_summary(run_dir: Path) -> list[str]:
    """What the parity probe read over the run: nothing when there was no probe."""
    from miles.records.run_logging import parity_drift, read_metrics

    try:
        rows = read_metrics(run_dir)
    except (OSError, ValueError):
        return []
    probed = [r for r in rows if "train/model_output_max_abs_diff" in r]
    off = [r["rollout_id"] for r in probed if parity_drift(r)]
    if not probed:
        return []
    if not off:
        return [f"parity exactly 0.0 at every rollout ({len(probed)} probed)"]
    worst = max(r["train/model_output_max_abs_diff"] for r in probed)
    return [f"OFF-POLICY: parity non-zero at rollouts {off} (max |diff| {worst:.4g})"]


def _submit_when_ready(
    launch: _Launch, config: ExecuteTrainConfig, hook: Callable[..., Any] | None, cluster_wait_timeout: float,
    causes: list[str] | None = None,
) -> int:
    """Submit once the cluster is ready; the job's own error line, if it fails without a failure
    record, goes to `causes` (the launcher's last line carries it: the error prints once)."""
    if config.num_nodes > 1:
        # nodes only: a node registers with all its GPUs at once, and GPU counts may differ per
        # node (a reward node); a recipe that needs a GPU total waits for it in its hook
        wait_for_cluster_resources(launch.job.address, num_nodes=config.num_nodes, timeout=cluster_wait_timeout)
    if hook is not None:
        gcs_address = launch.node.gcs_address if launch.node else None
        _call_hook(hook, ClusterInfo(launch.job.address, gcs_address, launch.plan.run_dir))
    if launch.node is None or config.num_nodes > 1:
        _refuse_layout_the_cluster_cannot_hold(launch)
    print_exec(redact_text(launch.job.display_command(), launch.secrets), Path(launch.plan.run_dir) / "job_command.txt")
    phases.mark("job_submit")
    return submit_and_follow(launch.job, Path(launch.plan.run_dir) / JOB_LOG, launch.secrets, causes)


def _call_hook(hook: Callable[..., Any], cluster: ClusterInfo) -> None:
    """Hooks take the ClusterInfo; one written without parameters is called without it."""
    if inspect.signature(hook).parameters:
        hook(cluster)
    else:
        hook()


@contextmanager
def _sigterm_as_interrupt():
    """A harness ends us with SIGTERM on timeout; treat it like Ctrl-C so the cluster is ended."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def on_sigterm(signum, frame):
        _SIGNALS_RECEIVED.append(signal.Signals(signum).name)
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_SIGNALS_RECEIVED: list[str] = []


def _interrupted_cause() -> str:
    how = _SIGNALS_RECEIVED[-1] if _SIGNALS_RECEIVED else "SIGINT (Ctrl-C)"
    return (f"launcher (pid {os.getpid()}, node {master_addr()}) received {how}: the job was stopped "
            f"[interrupted]")
