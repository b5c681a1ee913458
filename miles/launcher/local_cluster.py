"""Starting and ending Ray nodes of our own, recorded so that a later run can end exactly them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from miles.launcher.launch_mode import is_dry_run
from miles.launcher.multinode import LoopbackHeadError, check_worker_head
from miles.launcher.ray_auth import (
    DISABLED,
    ClusterAuth,
    RayAuthError,
    disabled_warning,
    joining_auth,
    write_fresh_token,
)
from miles.launcher.processes import (
    TERM_GRACE_S,
    LaunchRecord,
    end_token_processes,
    environ_with_token,
    exec_command,
    new_token,
    pgids_of,
    pids_with_token,
    print_exec,
)
from miles.utils.numerics import unpinned_environ
from miles.launcher.ray_cluster import (
    RayNodeSpec,
    RayPorts,
    declared_gpus,
    raise_open_files_limit,
    ray_start_command,
    ray_start_env,
    ray_temp_dir_for,
    run_in_own_session,
    split_host_port,
    tcp_reachable,
    visible_gpus,
)

HEAD_ROLE = "head"
WORKER_ROLE = "worker"
_OUR_TEMP_PREFIX = ray_temp_dir_for("")


def end_recorded_run(output_dir: str | Path, role: str) -> list[int]:
    """End what an earlier run of `role` with this output dir recorded; nothing else."""
    record = LaunchRecord.load(output_dir, role)
    if record is None:
        return []
    ended = end_token_processes(record.token, session=record.session)
    print(f"cleanup: ended {len(ended)} process(es) left by an earlier {role} run (token {record.token})", flush=True)
    _remove_our_temp_dir(record)
    _remove_auth_token(record)
    LaunchRecord.path_for(output_dir, role).unlink(missing_ok=True)
    return ended


def start_node(
    spec: RayNodeSpec,
    record: LaunchRecord,
    output_dir: str | Path,
    cuda_visible_devices: str | None,
    inherited_env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
    gpu_node: bool = False,
    *,
    auth: ClusterAuth,
) -> None:
    """`ray start` with the record's token in its environment; records the process groups.

    The node requires the cluster's Ray token (`auth`, named in its environment: ray_auth); a
    record that owns a token file (a head of ours) gets a fresh token there first.
    `inherited_env` reaches every worker and job on this node through the raylet's environment.
    A `gpu_node` (a node of a GPU job) starts without the CPU tier's numerics pins this process
    may hold (miles.utils.numerics.unpinned_environ): its workers would inherit them.
    Ray's start-up banner (and its advice to run Ray's stop-everything command, forbidden on a shared host)
    goes to `log_path` (default `<output_dir>/.launcher/<role>.log`), not to the terminal.
    """
    warn_open_files_once(open_files_needed(spec))
    record.save(output_dir)  # before starting: a crash mid-start must still be cleanable
    if record.auth_token_file:
        write_fresh_token(auth)
    env = node_env(record.token, cuda_visible_devices, inherited_env, gpu_node, auth=auth)
    log_path = Path(log_path) if log_path else LaunchRecord.path_for(output_dir, record.role).with_suffix(".log")
    _run_in_own_session(ray_start_command(spec, cuda_visible_devices), env, log_path, record, output_dir)
    record.pgids = pgids_of(pids_with_token(record.token))
    record.save(output_dir)


def node_env(token: str, cuda_visible_devices: str | None, inherited_env: Mapping[str, str] | None = None,
             gpu_node: bool = False, environ: Mapping[str, str] | None = None, *, auth: ClusterAuth) -> dict[str, str]:
    """The environment `ray start` runs in (and every worker of the node inherits): this process's
    (`environ`), without the CPU numerics pins on a GPU node, plus `inherited_env`, the launch
    token and the cluster's auth."""
    environ = os.environ if environ is None else environ
    base = unpinned_environ(environ) if gpu_node else dict(environ)
    return ray_start_env(environ_with_token(token, base, **(inherited_env or {})), cuda_visible_devices, auth)


# Descriptors a node's processes hold: about 15 daemons at ~100 each, and each worker (an actor or
# a task process) ~50 (sockets to the raylet, GCS and peers, its log files, the shared-memory store).
OPEN_FILES_BASE = 2048
OPEN_FILES_PER_CPU_OR_GPU = 256
_WARNED_OPEN_FILES: list[int] = []


def open_files_needed(spec: RayNodeSpec) -> int:
    """What the node's raylet needs at most: a base plus a share per slot that can hold a worker."""
    import os

    slots = (spec.num_cpus or os.cpu_count() or 1) + int(spec.num_gpus or 0)
    return OPEN_FILES_BASE + OPEN_FILES_PER_CPU_OR_GPU * slots


def warn_open_files_once(needed: int) -> int:
    """Raise the soft open-files limit to the hard one (the raylet inherits it); warn, once per
    launcher and only when it stays below what this node needs, with the fix."""
    soft = raise_open_files_limit(minimum=0)
    if soft < needed and not _WARNED_OPEN_FILES:
        _WARNED_OPEN_FILES.append(soft)
        print(f"WARNING: open-files limit {soft} is below the ~{needed} this Ray node may need (its raylet would "
              f"die later with 'Socket closed'); fix: raise the hard limit (ulimit -Hn / limits.conf) before "
              f"launching", file=sys.stderr, flush=True)
    return soft


# `ray start` returns in 5-30 s. Past this it is waiting on a daemon that died starting: Ray 2.60's
# `ray start` then waits for the node's registration without end (seen: a raylet whose object-manager
# port another process took).
RAY_START_TIMEOUT_S = 180.0


def _run_in_own_session(command: str, env: Mapping[str, str], log_path: Path, record: LaunchRecord,
                        output_dir: str | Path) -> None:
    """`ray start` as a session leader, the session recorded before it starts anything: its
    daemons stay members of that session, which is how cleanup finds them all (processes.py). The
    command (ports, temp dir: ~500 characters, no secret) is shown cut, whole in `<role>_command.txt`
    beside the log."""
    print_exec(command, log_path.with_name(f"{record.role}_command.txt"))
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def recorded(session: int) -> None:
        record.session = session
        record.save(output_dir)

    with open(log_path, "a") as log:
        try:
            returncode = run_in_own_session(command, env, log, recorded, timeout=RAY_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"`ray start` did not finish within {RAY_START_TIMEOUT_S:.0f} s (a daemon it starts, "
                               f"its raylet most often, died starting: a port of its taken by another process, or "
                               f"out of memory); Ray's output: {log_path}; fix: launch again (the launcher picks "
                               f"fresh ports)") from None
    if returncode:
        raise subprocess.CalledProcessError(returncode, command)


# SIGTERM to SIGKILL after a run that succeeded: it has nothing left to write, and an idle head's
# processes outlast any grace anyway (processes.TERM_GRACE_S); each own-head run saved 2.5 s
AFTER_SUCCESS_GRACE_S = 0.5


def stop_node(record: LaunchRecord, succeeded: bool = False, keep_logs: bool = False) -> None:
    """End the node's processes, then remove its temp dir (Ray's session logs, sockets, spilled
    objects: 2-6 MB a run) on every exit path unless `keep_logs` (--keep-ray-logs). After a
    failure the processes get the full grace. The job's own output stays in the run dir."""
    grace_s = AFTER_SUCCESS_GRACE_S if succeeded else TERM_GRACE_S
    ended = end_token_processes(record.token, grace_s=grace_s, session=record.session)
    print(f"ended the Ray node this launcher started ({len(ended)} process(es), token {record.token})", flush=True)
    if keep_logs:
        print(f"Ray's logs kept in {record.ray_temp_dir} (--keep-ray-logs)", flush=True)
    else:
        _remove_our_temp_dir(record)
    _remove_auth_token(record)


def _remove_auth_token(record: LaunchRecord) -> None:
    """The node is gone and its token opens nothing any more: its file goes too (never one the
    record does not own, such as the head's token a worker was given)."""
    if record.auth_token_file:
        Path(record.auth_token_file).unlink(missing_ok=True)


def _remove_our_temp_dir(record: LaunchRecord) -> None:
    # only a dir of the shape we create: a hand-edited record must not make us delete anything else
    if record.ray_temp_dir and record.ray_temp_dir.startswith(_OUR_TEMP_PREFIX):
        shutil.rmtree(record.ray_temp_dir, ignore_errors=True)


def start_ray_worker(
    head_address: str,
    *,
    output_dir: str | Path,
    num_gpus: int = 0,
    num_cpus: int | None = None,
    cuda_visible_devices: str | None = None,
    node_ip: str | None = None,
    role: str = WORKER_ROLE,
    poll_s: float = 2.0,
    head_lost_after: int = 3,
    keep_ray_logs: bool = False,
) -> int:
    """Join the Ray head at `head_address` (host:gcs_port) as another node and block.

    Returns 0 when interrupted (Ctrl-C / SIGTERM) or when the head goes away, 1 if our own node
    died or could not join; either way the node this call started is ended before returning. A
    loopback head is refused (2) unless every node runs on this host (multinode.SINGLE_HOST_ENV),
    and so is a launch without the head's Ray token (ray_auth.joining_auth: RAY_AUTH_TOKEN_PATH or
    RAY_AUTH_TOKEN); a dry run only says so.
    """
    refusals = []
    try:
        check_worker_head(head_address)
    except LoopbackHeadError as err:
        refusals.append(str(err))
    try:
        auth = joining_auth()
    except RayAuthError as err:
        refusals.append(str(err))
        auth = ClusterAuth(DISABLED)
    if refusals and not is_dry_run():
        print(f"error: {refusals[0]}", file=sys.stderr, flush=True)
        return 2
    for refusal in refusals:
        print(f"note: a real worker would refuse: {refusal}", file=sys.stderr, flush=True)
    if not auth.enabled and not is_dry_run():
        print(f"warning: {disabled_warning()}", file=sys.stderr, flush=True)
    node_ip = node_ip or _loopback_if_head_is(head_address)
    token = new_token()
    if not is_dry_run():  # never declare GPUs this machine does not have (a dry run plans for the recipe's)
        visible = visible_gpus(cuda_visible_devices)
        if declared_gpus(num_gpus, visible) < num_gpus:
            print(f"note: this node declares {declared_gpus(num_gpus, visible)} GPU(s), not {num_gpus}: "
                  f"{visible.how}", file=sys.stderr, flush=True)
        num_gpus = declared_gpus(num_gpus, visible)
    ports = RayPorts() if is_dry_run() else RayPorts.allocate(node_ip or "0.0.0.0")
    spec = RayNodeSpec(node_ip, ports, ray_temp_dir_for(token), num_gpus, num_cpus, head_address=head_address)
    if is_dry_run():
        exec_command(ray_start_command(spec, cuda_visible_devices), dry_run=True)
        return 0
    end_recorded_run(output_dir, role)
    record = LaunchRecord(role, token, ray_temp_dir=spec.temp_dir)
    status = 1
    try:
        start_node(spec, record, output_dir, cuda_visible_devices, gpu_node=num_gpus > 0, auth=auth)
        print(f"joined {head_address} as a Ray node (node {spec.node_ip or 'picked by Ray'}); Ray's output is in "
              f"{LaunchRecord.path_for(output_dir, role).with_suffix('.log')}; blocking until interrupted or the "
              f"head goes away", flush=True)
        status = _block_while_head_alive(head_address, token, poll_s, head_lost_after)
    except KeyboardInterrupt:
        print("interrupted: leaving the cluster", flush=True)
        status = 0
    except TimeoutError as err:
        print(f"error: this node could not join {head_address}: {err}", file=sys.stderr, flush=True)
    except subprocess.CalledProcessError as err:
        log = LaunchRecord.path_for(output_dir, role).with_suffix(".log")
        print(f"error: this node could not join {head_address}: `ray start` exited {err.returncode} (a missing or "
              f"wrong Ray token shows there as InvalidAuthToken); its output: {log}", file=sys.stderr, flush=True)
    finally:
        stop_node(record, succeeded=status == 0, keep_logs=keep_ray_logs)
    return status


def _loopback_if_head_is(head_address: str) -> str | None:
    """A head on loopback is only reachable from this host, so this node must bind loopback too;
    otherwise Ray finds the node's own address."""
    host, _ = split_host_port(head_address)
    return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else None


def _block_while_head_alive(head_address: str, token: str, poll_s: float, head_lost_after: int) -> int:
    host, port = split_host_port(head_address)
    misses = 0
    while True:
        time.sleep(poll_s)
        if not pids_with_token(token):
            print("our Ray node exited on its own", file=sys.stderr, flush=True)
            return 1
        misses = 0 if tcp_reachable(host, port) else misses + 1
        if misses >= head_lost_after:
            print(f"head {head_address} is gone: leaving", flush=True)
            return 0
