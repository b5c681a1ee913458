"""`execute_train`: plan a launch, then (unless it is a dry run) clean up after an earlier run,
start a Ray head of our own, submit the job, follow it and end the head again."""

from __future__ import annotations

import inspect
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.utils.external_utils.config import REPO_ROOT, ExecuteTrainConfig
from miles.utils.external_utils.env_vars import (
    ExtraEnvVarsError,
    build_job_env_vars,
    is_secret_name,
    master_addr,
    parse_extra_env_vars,
    redact_env,
)
from miles.utils.external_utils.flags import LockedFlagError, assemble_argv, check_locked_flags, locked_flag_values
from miles.utils.external_utils.job_submit import INTERRUPTED_EXIT_CODE, JobRequest, submit_and_follow
from miles.utils.external_utils.launch_mode import external_job_server, is_dry_run, is_external_ray
from miles.utils.external_utils.local_cluster import HEAD_ROLE, end_recorded_run, start_node, stop_node
from miles.utils.external_utils.plan import LaunchPlan
from miles.utils.external_utils.processes import LaunchRecord, new_token, print_exec
from miles.utils.external_utils.ray_cluster import (
    RayNodeSpec,
    RayPorts,
    cpu_job_num_cpus,
    ray_start_command,
    ray_temp_dir_for,
    wait_for_cluster_resources,
)

DEFAULT_TRAIN_SCRIPT = "train_diffusion.py"


@dataclass(frozen=True)
class ClusterInfo:
    """What a before_ray_job_submit hook is told about the cluster the job is about to go to."""

    job_server_url: str
    gcs_address: str | None  # None for an external cluster
    run_dir: str


class LaunchError(RuntimeError):
    """A launch refused before anything started; the message says why and how to fix it."""


@dataclass
class _Launch:
    plan: LaunchPlan
    job: JobRequest
    node: RayNodeSpec | None  # None with an external cluster
    token: str
    node_secrets: dict[str, str]


def execute_train(
    train_args: str,
    num_gpus_per_node: int,
    config: ExecuteTrainConfig,
    *,
    locked_flags: Iterable[str] | Mapping[str, str] | None = (),
    before_ray_job_submit: Callable[..., Any] | None = None,
    train_script: str = DEFAULT_TRAIN_SCRIPT,
    ray_head_port: int | None = None,
    cluster_wait_timeout: float = 1800.0,
) -> None:
    """Run `python3 <train_script> --run-dir <output_dir>/<run_id> <train_args> <extra_args>` as a
    Ray job on a fresh cluster of our own (or the external one), and exit with its status.

    num_gpus_per_node=0 is a CPU job. With num_nodes > 1 the job is submitted only once the
    cluster holds num_nodes nodes: run `start_ray_worker` on the other nodes, pointing at this
    head (`ray_head_port` fixes its GCS port so they can find it).
    `before_ray_job_submit(cluster_info)` runs right before submitting (not in a dry run), e.g. to
    wait for a GPU total with `wait_for_cluster_resources`.
    """
    try:
        launch = _plan_launch(train_args, num_gpus_per_node, config, locked_flags, train_script, ray_head_port)
    except (LaunchError, LockedFlagError, ExtraEnvVarsError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    launch.plan.write()
    if launch.plan.dry_run:
        _show_dry_run(launch, before_ray_job_submit)
        return
    status = _run_launch(launch, config, before_ray_job_submit, cluster_wait_timeout)
    if status != 0:
        raise SystemExit(status)


def _plan_launch(
    train_args: str,
    num_gpus_per_node: int,
    config: ExecuteTrainConfig,
    locked_flags: Iterable[str] | Mapping[str, str] | None,
    train_script: str,
    ray_head_port: int | None,
) -> _Launch:
    dry, external = is_dry_run(), is_external_ray()
    _refuse_external_with_devices(external, config.cuda_visible_devices)
    locked = locked_flag_values(train_args, locked_flags)
    check_locked_flags(config.extra_args, locked)
    env_vars = build_job_env_vars(REPO_ROOT, parse_extra_env_vars(config.extra_env_vars))
    run_dir = str(Path(config.output_dir).resolve() / config.run_id)
    argv = assemble_argv(run_dir, train_args, config.extra_args)
    token = new_token()
    node = None if external else _head_spec(token, num_gpus_per_node, dry, ray_head_port)
    # Ray's runtime-env agent writes the runtime env, values included, to its log file. On a head
    # of our own, secrets therefore reach the job through the raylet's inherited environment
    # instead; an external cluster leaves the runtime env as the only way in.
    node_secrets = {} if external else {k: v for k, v in env_vars.items() if is_secret_name(k)}
    job = JobRequest(
        address=external_job_server() if external else node.job_server_url,
        entrypoint=shlex.join(["python3", str(_resolve_train_script(train_script)), *argv]),
        env_vars=env_vars,
        submission_id=f"miles-{config.run_id}-{token[:6]}",
        inherited=frozenset(node_secrets),
    )
    start_head = [] if node is None else [ray_start_command(node, config.cuda_visible_devices)]
    commands = [*start_head, job.display_command()]
    plan = LaunchPlan(
        recipe=_recipe_name(), run_id=config.run_id, run_dir=run_dir, train_script=train_script, argv=argv,
        locked_flags=locked, runtime_env={"env_vars": redact_env(env_vars)}, num_nodes=config.num_nodes,
        num_gpus_per_node=num_gpus_per_node,
        cuda_visible_devices=config.cuda_visible_devices or os.environ.get("CUDA_VISIBLE_DEVICES"),
        external_ray=external, dry_run=dry,
        ray=({"job_server": job.address} if node is None else node.plan_entry()), commands=commands,
    )
    return _Launch(plan, job, node, token, node_secrets)


def _refuse_external_with_devices(external: bool, cuda_visible_devices: str) -> None:
    if external and cuda_visible_devices:
        raise LaunchError(
            f"--cuda-visible-devices {cuda_visible_devices} is refused with MILES_SCRIPT_EXTERNAL_RAY=1: an "
            "external cluster already fixed its GPUs when each `ray start` ran. Export CUDA_VISIBLE_DEVICES "
            "before `ray start` on each node instead, and leave --cuda-visible-devices empty."
        )


def _head_spec(token: str, num_gpus_per_node: int, dry: bool, ray_head_port: int | None) -> RayNodeSpec:
    host = master_addr()
    # a dry run reserves nothing: ports show as 0, meaning "picked free when the head starts"
    ports = RayPorts(gcs_port=ray_head_port or 0) if dry else RayPorts.allocate(host, gcs_port=ray_head_port)
    return RayNodeSpec(host, ports, ray_temp_dir_for(token), num_gpus_per_node, cpu_job_num_cpus(num_gpus_per_node))


def _resolve_train_script(train_script: str) -> Path:
    path = Path(train_script)
    return path if path.is_absolute() else REPO_ROOT / path


def _recipe_name() -> str:
    script = Path(sys.argv[0]).resolve()
    try:
        return str(script.relative_to(REPO_ROOT))
    except ValueError:
        return str(script)


def _show_dry_run(launch: _Launch, hook: Callable[..., Any] | None) -> None:
    print("dry run (MILES_SCRIPT_ENABLE_RAY_SUBMIT=0): nothing below is executed", flush=True)
    if launch.node is not None:
        print("cleanup: would end what an earlier run with this --output-dir recorded", flush=True)
    for command in launch.plan.commands:
        print_exec(command)
    if hook is not None:
        print(f"before_ray_job_submit: would call {getattr(hook, '__name__', hook)!s} before submitting")
    print(f"plan: {Path(launch.plan.run_dir) / 'plan.json'}", flush=True)


def _run_launch(
    launch: _Launch, config: ExecuteTrainConfig, hook: Callable[..., Any] | None, cluster_wait_timeout: float
) -> int:
    """Returns the job's exit status; the head this started is ended whatever happens."""
    record = None
    status = 1
    try:
        with _sigterm_as_interrupt():
            if launch.node is not None:
                end_recorded_run(config.output_dir, HEAD_ROLE)
                record = LaunchRecord(HEAD_ROLE, launch.token, ray_temp_dir=launch.node.temp_dir)
                start_node(launch.node, record, config.output_dir, config.cuda_visible_devices, launch.node_secrets)
            status = _submit_when_ready(launch, config, hook, cluster_wait_timeout)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        status = INTERRUPTED_EXIT_CODE
    except subprocess.CalledProcessError as err:
        print(f"error: command failed with status {err.returncode}: {err.cmd}", file=sys.stderr, flush=True)
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
    finally:
        if record is not None:
            stop_node(record, remove_temp_dir=status == 0)
    return status


def _submit_when_ready(
    launch: _Launch, config: ExecuteTrainConfig, hook: Callable[..., Any] | None, cluster_wait_timeout: float
) -> int:
    if config.num_nodes > 1:
        # nodes only: a node registers with all its GPUs at once, and GPU counts may differ per
        # node (a reward node); a recipe that needs a GPU total waits for it in its hook
        wait_for_cluster_resources(launch.job.address, num_nodes=config.num_nodes, timeout=cluster_wait_timeout)
    if hook is not None:
        gcs_address = launch.node.gcs_address if launch.node else None
        _call_hook(hook, ClusterInfo(launch.job.address, gcs_address, launch.plan.run_dir))
    print_exec(launch.job.display_command())
    return submit_and_follow(launch.job)


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
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
