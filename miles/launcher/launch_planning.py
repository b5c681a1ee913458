"""A launch's plan before anything starts: the recipe's flags checked against the host and
train_diffusion.py's own rules, the memory plan's verdict, the head's spec, the job's argv, env
and namespace (`_Launch`), and plan.json written beside the run. `execute_train` (train_launch)
asks for it before anything is started."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from miles.launcher.config import DEFAULT_TRAIN_SCRIPT, REPO_ROOT, ExecuteTrainConfig, check_run_id
from miles.launcher.env_vars import build_job_env_vars, cuda_core_dump_env, is_secret_name, master_addr, parse_extra_env_vars, redact_env, redact_text, secret_values
from miles.launcher.flags import assemble_argv, check_locked_flags, locked_flag_values
from miles.launcher.job_submit import JobRequest
from miles.launcher.launch_mode import RAY_ADDRESS_ENV, dashboard_host, dry_run_switch, external_address, is_external_ray
from miles.launcher import ray_auth
from miles.launcher.multinode import LoopbackHeadError, check_head_address
from miles.launcher.plan import LaunchPlan
from miles.launcher.processes import RECIPE_COMMANDS, new_token
from miles.launcher.ray_cluster import RayNodeSpec, RayPorts, alive_node_offers, cpu_job_num_cpus, declared_gpus, layout_verdict, open_to_network, ray_start_command, ray_temp_dir_for, visible_gpus
from miles.launcher.deferred_fetches import launching, run_deferred
from miles.launcher.launch_errors import LaunchError
from miles.launcher.launch_checks import check_before_fetch, parse_train_argv, resolve_train_script
from miles.launcher.released_assets import gated_assets_in, resolve_checkpoints_in_argv
from miles.flags.flag_vocabulary import translate
from miles.records.hub_snapshots import hub_revisions_in_argv


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
