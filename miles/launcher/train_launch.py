"""`execute_train`: plan a launch, then (unless it is a dry run) clean up after an earlier run,
start a Ray head of our own, submit the job, follow it and end the head again."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from miles.records import phases
from miles.launcher.config import DEFAULT_TRAIN_SCRIPT, ExecuteTrainConfig, ScriptOptionError
from miles.launcher.env_vars import ExtraEnvVarsError, redact_text
from miles.launcher.flags import LockedFlagError
from miles.launcher.launch_mode import LaunchModeError
from miles.launcher.plan import LaunchPlan
from miles.launcher.processes import print_exec
from miles.launcher.ray_cluster import this_machine
from miles.launcher.launch_errors import LaunchError, TrainArgvError  # noqa: F401 (ours to import too)
from miles.launcher.launch_checks import TrainScriptError, resolve_train_script
from miles.launcher.released_assets import AssetMissingError
from miles.flags.flag_vocabulary import FlagRefused
from miles.launcher.launch_planning import _Launch, _plan_launch, _write_plan
from miles.launcher.launch_run import _run_launch


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


def _show_dry_run(launch: _Launch, hook: Callable[..., Any] | None) -> None:
    print(f"dry run ({launch.plan.dry_run_decided_by}=0): nothing below is executed", flush=True)
    if launch.node is not None:
        print("cleanup: would end what an earlier run with this --output-dir recorded", flush=True)
    for command in launch.plan.commands:
        print_exec(redact_text(command, launch.secrets))
    if hook is not None:
        print(f"before_ray_job_submit: would call {getattr(hook, '__name__', hook)!s} before submitting")
    print(f"plan: {Path(launch.plan.run_dir) / 'plan.json'}", flush=True)
