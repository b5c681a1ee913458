"""`execute_train`: plan a launch, then (unless it is a dry run) clean up after an earlier run,
start a Ray head of our own, submit the job, follow it and end the head again."""

from __future__ import annotations

import dataclasses
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

from miles.records import phases
from miles.launcher import restarts
from miles.launcher.config import (
    DEFAULT_TRAIN_SCRIPT,
    REPO_ROOT,
    ExecuteTrainConfig,
    ScriptOptionError,
    check_run_id,
)
from miles.launcher.env_vars import (
    ExtraEnvVarsError,
    build_job_env_vars,
    cuda_core_dump_env,
    is_secret_name,
    master_addr,
    parse_extra_env_vars,
    redact_env,
    redact_text,
    secret_values,
)
from miles.launcher.flags import (
    LockedFlagError,
    assemble_argv,
    check_locked_flags,
    flag_values,
    locked_flag_values,
)
from miles.launcher.job_submit import INTERRUPTED_EXIT_CODE, JobRequest, submit_and_follow
from miles.launcher.launch_mode import (
    RAY_ADDRESS_ENV,
    LaunchModeError,
    check_reachable,
    dashboard_host,
    dry_run_switch,
    external_address,
    is_external_ray,
)
from miles.launcher import ray_auth
from miles.launcher.local_cluster import HEAD_ROLE, end_recorded_run, start_node, stop_node
from miles.launcher.multinode import LoopbackHeadError, check_head_address
from miles.launcher.plan import LaunchPlan
from miles.launcher.processes import RECIPE_COMMANDS, LaunchRecord, new_token, print_exec
from miles.launcher.ray_cluster import (
    RayNodeSpec,
    RayPorts,
    alive_node_offers,
    cpu_job_num_cpus,
    declared_gpus,
    layout_verdict,
    open_to_network,
    ray_start_command,
    ray_temp_dir_for,
    this_machine,
    visible_gpus,
    wait_for_cluster_resources,
)
from miles.launcher.deferred_fetches import launching, run_deferred
from miles.launcher.launch_errors import LaunchError, TrainArgvError  # noqa: F401 (ours to import too)
from miles.launcher.launch_checks import (
    TrainScriptError,
    check_before_fetch,
    parse_train_argv,
    resolve_train_script,
)
from miles.launcher.released_assets import (
    AssetMissingError,
    gated_assets_in,
    resolve_checkpoints_in_argv,
)
from miles.flags.flag_vocabulary import FlagRefused, translate
from miles.records.hub_snapshots import hub_revisions_in_argv

LAUNCHER_LOG = "launcher.log"  # Ray's start-up output and the launcher's own tracebacks
JOB_LOG = "job.log"  # the job's whole output, secrets redacted


@dataclass(frozen=True)
class ClusterInfo:
    """What a before_ray_job_submit hook is told about the cluster the job is about to go to."""

    job_server_url: str
    gcs_address: str | None  # None for an external cluster
    run_dir: str


@dataclass
class _Launch:
    plan: LaunchPlan
    job: JobRequest
    node: RayNodeSpec | None  # None with an external cluster
    token: str
    node_secrets: dict[str, str]
    secrets: list[str]  # values to redact from anything shown or written
    head_port: int | None = None  # a fixed GCS port (multi-node), kept across restarts
    device: str = "cuda"  # the run's --device: a GPU run's head starts without the CPU numerics pins
    auth: ray_auth.ClusterAuth | None = None  # our head's (planned); an external cluster's once asked


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
    phases.mark("launch_start")
    try:
        launch = _plan_launch(train_args, num_gpus_per_node, config, locked_flags, train_script, ray_head_port)
        refuse_bad_inputs(launch, config)  # preflight: before anything is written or started
        _write_plan(launch.plan)
        phases.mark("launch_planned")
        _print_upstream_notes(launch.plan)
        if launch.plan.memory_plan:
            print("\n".join(launch.plan.memory_plan), flush=True)
        if launch.plan.memory_plan_error:  # written to plan.json first, so the dry check can show the estimate
            raise LaunchError(f"{launch.plan.memory_plan_error} (plan: {Path(launch.plan.run_dir) / 'plan.json'})")
    except (LaunchError, LockedFlagError, ExtraEnvVarsError, LaunchModeError, ScriptOptionError,
            AssetMissingError, FlagRefused, TrainScriptError) as err:
        print(f"error: {_in_recipe_terms(err, config)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if launch.plan.dry_run:
        _show_dry_run(launch, before_ray_job_submit)
        return
    status = _run_launch(launch, config, before_ray_job_submit, cluster_wait_timeout)
    if status != 0:
        raise SystemExit(status)


def _in_recipe_terms(err: Exception, config: ExecuteTrainConfig) -> str:
    """A refusal about the train ranks, from a recipe that sets them with its own --train-ranks,
    names that flag first: the train flags it mentions are the recipe's, not the user's."""
    ranks = getattr(config, "train_ranks", None)
    if isinstance(err, TrainArgvError) and ranks is not None and "train ranks" in str(err):
        return f"--train-ranks {ranks}: {err}"
    return str(err)


def refuse_bad_inputs(launch: _Launch, config: ExecuteTrainConfig) -> None:
    """The preflight (miles.launcher.preflight) over the assembled train argv; a refusal
    is recorded beside whatever the run dir already holds and ends the launch with one line."""
    from miles.launcher import preflight

    if not resolve_train_script(launch.plan.train_script).ours:
        return  # another trainer's flags are not ours to check
    host = preflight.HostFacts(
        num_nodes=config.num_nodes, cuda_visible_devices=config.cuda_visible_devices or "",
        dry_run=launch.plan.dry_run,
        import_paths=tuple(p for p in launch.job.env_vars.get("PYTHONPATH", "").split(":") if p))
    try:
        preflight.preflight(list(launch.plan.argv), host)
    except (preflight.PreflightError, ValueError) as err:
        reason = redact_text(str(err), launch.secrets)
        preflight.write_refusal(launch.plan.run_dir, reason, redact_text(shlex.join(launch.plan.argv), launch.secrets))
        raise LaunchError(reason) from None


def _print_upstream_notes(plan: LaunchPlan) -> None:
    """What became of miles-diffusion's flags and which gated repositories need a licence and token."""
    from miles.launcher.released_assets import gated_note

    for key, what in (("mapped", "maps onto"), ("no_counterpart", "has no counterpart here")):
        for line in plan.upstream_flags.get(key, []):
            print(f"note: miles-diffusion flag {line}" if key == "mapped" else f"note: {line.split(':', 1)[0]} {what}"
                  f" ({line.split(': ', 1)[1]}); left out of the job", flush=True)
    if "train_script" in plan.upstream_flags:
        print(f"note: train_script {plan.upstream_flags['train_script']}", flush=True)
    for asset in plan.gated_assets:
        print(f"note: {gated_note(asset['repo'])}", flush=True)


def _write_plan(plan: LaunchPlan) -> None:
    """The first write of a launch: an unwritable --output-dir is one line, not a traceback. A
    launch refused for its memory plan leaves an earlier run's plan.json alone."""
    from miles.launcher import preflight

    if plan.memory_plan_error and (Path(plan.run_dir) / "plan.json").exists():
        preflight.write_refusal(plan.run_dir, plan.memory_plan_error, shlex.join(plan.argv), plan=plan.to_dict())
        return
    try:
        plan.write()
    except OSError as err:
        raise LaunchError(
            f"cannot write the run directory {plan.run_dir}: {err.strerror or err}; fix: pick an --output-dir "
            f"you can write to"
        ) from None


def validate_train_argv(argv: list[str]):
    """train_diffusion.py's own parser and rules over the assembled argv, in this process (no
    torch, no Ray, no weights read): raises TrainArgvError with train_diffusion.py's message.
    Returns the memory plan (miles.plan.memory_plan.MemoryPlan), built from the checkpoint's
    configs and safetensors headers or the committed table (the caller enforces it), and the
    run's --device (its job env depends on it: miles.utils.numerics.job_numerics_env)."""
    from miles.plan.memory_plan import build_memory_plan

    ns, batch_plan = parse_train_argv(argv)
    return build_memory_plan(ns, batch_plan), ns.device


def _plan_launch(
    train_args: str,
    num_gpus_per_node: int,
    config: ExecuteTrainConfig,
    locked_flags: Iterable[str] | Mapping[str, str] | None,
    train_script: str,
    ray_head_port: int | None,
) -> _Launch:
    (dry, dry_decided_by), external = dry_run_switch(), is_external_ray()
    _refuse_external_with_devices(external, config.cuda_visible_devices)
    _refuse_too_few_devices(config.cuda_visible_devices, num_gpus_per_node)
    check_run_id(config.run_id)
    locked = locked_flag_values(train_args, locked_flags)
    check_locked_flags(config.extra_args, locked)
    extra_env = parse_extra_env_vars(config.extra_env_vars)
    run_dir = str(Path(config.output_dir).resolve() / config.run_id)
    if getattr(config, "cuda_core_dump", False):  # --extra-env-vars still win
        extra_env = {**cuda_core_dump_env(run_dir), **extra_env}
    launching()  # prepare()'s queued downloads are this launch's to run, once its checks pass
    script = resolve_train_script(train_script)
    vocabulary = translate(assemble_argv(run_dir, train_args, config.extra_args))  # miles-diffusion's flags
    if script.ours:
        check_before_fetch(vocabulary.argv, config, num_gpus_per_node, dry=dry, external=external)
    run_deferred()  # prepare()'s downloads, once nothing that needs no asset can refuse the launch
    # a hub id given to --hf-checkpoint (in the recipe or --extra-args) becomes its cached snapshot
    argv = resolve_checkpoints_in_argv(vocabulary.argv)
    memory, device = None, "cpu" if num_gpus_per_node == 0 else "cuda"  # another trainer: by its GPUs
    if script.ours:
        memory, device = validate_train_argv(argv)
    env_vars = build_job_env_vars(REPO_ROOT, extra_env, device=device)
    address, address_from = _job_server_address(external)
    token = new_token()
    node = None if external else _head_spec(token, num_gpus_per_node, dry, ray_head_port, config.cuda_visible_devices)
    auth = None if external else ray_auth.own_cluster_auth(run_dir)  # an external cluster's: asked at launch
    if node is not None:
        _refuse_loopback_head(config.num_nodes, node.node_ip, dry)
    if auth is not None and not auth.enabled:
        print(f"warning: {ray_auth.disabled_warning()}", file=sys.stderr, flush=True)
    # Ray's runtime-env agent writes the runtime env, values included, to its log file. On a head
    # of our own, secrets therefore reach the job through the raylet's inherited environment
    # instead; an external cluster leaves the runtime env as the only way in.
    node_secrets = {} if external else {k: v for k, v in env_vars.items() if is_secret_name(k)}
    job = JobRequest(
        address=address or node.job_server_url,
        entrypoint=shlex.join(["python3", str(script.path), *argv]),
        env_vars=env_vars,
        submission_id=f"miles-{config.run_id}-{token[:6]}",
        inherited=frozenset(node_secrets),
    )
    start_head = [] if node is None else [ray_start_command(node, config.cuda_visible_devices)]
    commands = [*start_head, job.display_command()]
    prepared = [redact_text(c, secret_values(env_vars)) for c in _take_recipe_commands()]
    upstream = vocabulary.plan_entry() | ({"train_script": script.mapped_from} if script.mapped_from else {})
    plan = LaunchPlan(
        recipe=_recipe_name(), run_id=config.run_id, run_dir=run_dir,
        train_script=DEFAULT_TRAIN_SCRIPT if script.mapped_from else train_script, argv=argv,
        locked_flags=locked, runtime_env={"env_vars": redact_env(env_vars)}, num_nodes=config.num_nodes,
        num_gpus_per_node=num_gpus_per_node,
        cuda_visible_devices=config.cuda_visible_devices or os.environ.get("CUDA_VISIBLE_DEVICES"),
        external_ray=external, dry_run=dry, dry_run_decided_by=dry_decided_by,
        ray=({"job_server": job.address, "address_from": address_from, "auth": "the mode the cluster reports"}
             if node is None else {**node.plan_entry(), "job_server": job.address, "address_from": "own head",
                                   "auth": auth.plan_entry(), "open_to_network": open_to_network(node, auth)}),
        commands=commands,
        prepare_commands=prepared,
        hub_revisions=hub_revisions_in_argv(argv),
        upstream_flags=upstream,
        gated_assets=gated_assets_in([*vocabulary.argv, *prepared]),
        memory_plan=memory.lines if memory is not None else [],
        memory_plan_error=_memory_error(memory),
    )
    return _Launch(plan, job, node, token, node_secrets, secret_values(env_vars), ray_head_port, device, auth)


def _take_recipe_commands() -> list[str]:
    """What the recipe ran since the previous launch of this process (a pipeline launches per step)."""
    taken = list(RECIPE_COMMANDS)
    RECIPE_COMMANDS.clear()
    return taken


def _memory_error(memory) -> str | None:
    from miles.plan.memory_plan import MemoryPlanError

    try:
        if memory is not None:
            memory.check()
    except MemoryPlanError as err:
        return str(err)
    return None


def _job_server_address(external: bool) -> tuple[str | None, str]:
    """External mode: the validated explicit address. Otherwise None (our own head's), and an
    inherited RAY_ADDRESS is dropped from this process so Ray's client cannot prefer it."""
    if external:
        address, source = external_address()
        os.environ.pop(RAY_ADDRESS_ENV, None)  # Ray's client would prefer it over the one we pass
        return address, source
    inherited = os.environ.pop(RAY_ADDRESS_ENV, None)
    if inherited:
        print(f"note: ignoring {RAY_ADDRESS_ENV}={inherited}: this launcher submits only to the head it starts "
              f"(for an existing cluster set MILES_SCRIPT_EXTERNAL_RAY=1)", file=sys.stderr, flush=True)
    return None, "own head"


def _refuse_loopback_head(num_nodes: int, head_host: str, dry: bool) -> None:
    """Refused before the head starts; a dry run shows the plan and says a real launch would stop."""
    try:
        check_head_address(num_nodes, head_host)
    except LoopbackHeadError as err:
        if not dry:
            raise LaunchError(str(err)) from None
        print(f"note: a real launch would be refused: {err}", file=sys.stderr, flush=True)


def _refuse_too_few_devices(cuda_visible_devices: str, num_gpus_per_node: int) -> None:
    devices = [d for d in (cuda_visible_devices or "").split(",") if d.strip()]
    if devices and len(devices) < num_gpus_per_node:
        raise LaunchError(
            f"--cuda-visible-devices {cuda_visible_devices} lists {len(devices)} GPU(s) but this recipe needs "
            f"{num_gpus_per_node} per node; fix: list {num_gpus_per_node} GPUs or leave the option empty"
        )


def _refuse_external_with_devices(external: bool, cuda_visible_devices: str) -> None:
    if external and cuda_visible_devices:
        raise LaunchError(
            f"--cuda-visible-devices {cuda_visible_devices} is refused with MILES_SCRIPT_EXTERNAL_RAY=1: an "
            "external cluster already fixed its GPUs when each `ray start` ran. Export CUDA_VISIBLE_DEVICES "
            "before `ray start` on each node instead, and leave --cuda-visible-devices empty."
        )


def _head_spec(token: str, num_gpus_per_node: int, dry: bool, ray_head_port: int | None,
               cuda_visible_devices: str | None = None) -> RayNodeSpec:
    host = master_addr()
    # a dry run reserves nothing: ports show as 0, meaning "picked free when the head starts"
    ports = RayPorts(gcs_port=ray_head_port or 0) if dry else RayPorts.allocate(host, gcs_port=ray_head_port)
    # a dry run plans for the recipe's machine; a real head declares only GPUs this machine has
    gpus = num_gpus_per_node if dry else declared_gpus(num_gpus_per_node, visible_gpus(cuda_visible_devices))
    return RayNodeSpec(host, ports, ray_temp_dir_for(token), gpus, cpu_job_num_cpus(num_gpus_per_node),
                       dashboard_host=dashboard_host())


def _train_namespace(launch: _Launch):
    """train_diffusion.py's parsed flags of this launch (None for another train script)."""
    if not resolve_train_script(launch.plan.train_script).ours:
        return None
    return parse_train_argv(launch.plan.argv)[0]  # validate_train_argv accepted it already


def _refuse_layout_the_cluster_cannot_hold(launch: _Launch) -> None:
    """Before submitting to a cluster of several nodes or an external one: the same rule against
    its alive nodes. Nodes still missing are left to the driver, which waits for them."""
    ns = _train_namespace(launch)
    if ns is None:
        return
    verdict = layout_verdict(ns, alive_node_offers(launch.job.address))
    if verdict.never:
        raise LaunchError(f"the cluster cannot run the recipe's layout: {verdict.reason}; fix: run it where the "
                          f"resources are, or pick a smaller --scale")
    if verdict.reason:
        print(f"note: {verdict.reason}; the job waits for them (--placement-timeout-s {ns.placement_timeout_s:g})",
              flush=True)


def _recipe_name() -> str:
    script = Path(sys.argv[0]).resolve()
    try:
        return str(script.relative_to(REPO_ROOT))
    except ValueError:
        return str(script)


def _show_dry_run(launch: _Launch, hook: Callable[..., Any] | None) -> None:
    print(f"dry run ({launch.plan.dry_run_decided_by}=0): nothing below is executed", flush=True)
    if launch.node is not None:
        print("cleanup: would end what an earlier run with this --output-dir recorded", flush=True)
    for command in launch.plan.commands:
        print_exec(redact_text(command, launch.secrets))
    if hook is not None:
        print(f"before_ray_job_submit: would call {getattr(hook, '__name__', hook)!s} before submitting")
    print(f"plan: {Path(launch.plan.run_dir) / 'plan.json'}", flush=True)


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
