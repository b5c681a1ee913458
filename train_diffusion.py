"""The training entry point: parse and validate the flags, show the batch plan, train.

Nothing at module level imports torch or Ray, so `--help` and `--validate-only` stay instant.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from typing import Sequence

from miles.plan.command_line import parse_command_line
from miles.flags.batching import BatchPlan
from miles.plan.memory_plan import build_memory_plan
from miles.records import phases
from miles.utils.numerics import pin_this_process, unpin_this_process


def main(argv: Sequence[str] | None = None) -> int:
    phases.mark("driver_process_start", t=phases.process_started_at())
    try:
        args, plan = parse_command_line(argv, preflight=refuse_bad_files)
    except SystemExit as exit:  # --help, --validate-only, and every parse error end here
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    print(plan.table(), flush=True)
    print(build_memory_plan(args, plan).table(), flush=True)  # parse_command_line refused one over budget
    # before train() imports torch: a direct run gets the launcher's numerics too (CPU runs only:
    # a GPU run's processes get the documented host thread count, miles.utils.numerics)
    if args.device == "cpu":
        pin_this_process()
    else:
        unpin_this_process()
    try:
        return train(args, plan)
    except Exception as err:  # one line here; the traceback goes to the run dir
        return report_failure(args, err)


def refuse_bad_files(args: Namespace) -> None:
    """The launcher's preflight (miles.launcher.preflight: files, directories, the
    checkpoint, custom functions, LoRA targets), so a direct run refuses what a recipe would, in one
    line and before Ray starts. --validate-only checks them as a recipe's dry run does: what exists
    is checked in full; a checkpoint or prompt file not there yet is named, and left to the run."""
    import os
    from pathlib import Path

    from miles.launcher import preflight

    host = preflight.HostFacts(num_nodes=args.num_nodes or 1, cuda_visible_devices="", dry_run=args.validate_only,
                               import_paths=tuple(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p))
    if args.validate_only:
        for flag, path in (("--hf-checkpoint", args.hf_checkpoint), ("--prompt-data", args.prompt_data),
                           ("--eval-prompt-data", args.eval_prompt_data)):
            if path and not Path(path).exists():
                print(f"note: {flag} {path} is not here: not checked (a run refuses it before Ray starts)",
                      file=sys.stderr)
    try:
        preflight.check_parsed(args, host)
    except preflight.PreflightError as err:
        print(f"train_diffusion.py: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def report_failure(args: Namespace, err: BaseException) -> int:
    """Print the cause as one line (the last line of the job's output, which the launcher repeats)
    and keep the whole traceback in <run_dir>/traceback.txt."""
    import traceback
    from pathlib import Path

    text = "".join(traceback.format_exception(err))
    # an actor's own traceback (its constructor or a call raised): for the job log, above the one line
    detail = getattr(err, "detail", "") or (str(err) if getattr(err, "miles_member", None) is not None else "")
    if detail:
        text += f"\nthe actor's traceback:\n{detail}\n"
        print(detail, file=sys.stderr, flush=True)
    cause = err
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:  # Ray wraps the actor's error
        cause = cause.cause
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    where = "traceback above"
    try:
        path = Path(args.run_dir or ".") / "traceback.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        where = f"traceback: {path}"
    except OSError:
        print(text, file=sys.stderr)
    headline = f"{type(cause).__name__}: {lines[0] if lines else '(no message)'}"
    try:  # who failed and whether a restart may help, for the launcher (miles.ray.faults)
        from miles.ray import faults

        failure = faults.classify(err)
        if isinstance(err, faults.RunFailure) or failure.role != "driver":
            headline = failure.line()
        if getattr(args, "run_dir", None):
            faults.write_failure(args.run_dir, failure, _last_checkpoint(getattr(args, "save", None)))
    except Exception as note:  # the one line below matters more than the record
        print(f"(could not record the failure: {note})", file=sys.stderr)
    print(f"train_diffusion.py: error: {headline} ({where})", file=sys.stderr, flush=True)
    return 1


def _last_checkpoint(save: str | None):
    if not save:
        return None
    from miles.backends import checkpoint as ckpt

    return ckpt.latest_checkpoint(save)


def train(args: Namespace, plan: BatchPlan) -> int:
    """DESIGN section 5: per rollout id, generate -> train -> update weights; eval and save on intervals."""
    import os
    import time

    from miles.utils.import_cost import collector_paused

    with collector_paused():  # torch and Ray: 1.5 -> 1.27 CPU-s (miles.utils.import_cost)
        import ray

        import miles.ray.rollout_manager  # noqa: F401  the heavy imports (torch, diffusers) fall in their phase
        import miles.ray.train_actor_group  # noqa: F401
        from miles.ray import faults
        from miles.ray.placement import place_run

    phases.mark("driver_imports_done")
    args.run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    # set before the first actor starts: cuBLAS reads it at initialisation
    runtime_env = {"env_vars": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}} if args.deterministic_mode else None
    if args.deterministic_mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    loading = refuse_foreign_checkpoints(args)  # before Ray: a refused run starts nothing
    owns_ray = not ray.is_initialized()  # a caller's own connection (tests run us in-process) is theirs to end
    if owns_ray:
        # Ray's own INFO line names the GCS by the host's routable address, while the launcher and the
        # plan say 127.0.0.1: its banner is silenced and one line of ours names the address as given
        ray.init(address=_job_ray_address(), logging_level="WARNING")
        print(f"driver: connected to the Ray cluster at {_job_ray_address() or 'the local one'}", flush=True)
    faults.configure(args)
    placement, pg = place_run(args)  # waits for --num-nodes nodes; refuses a layout they can never hold
    try:
        _train_placed(args, plan, placement, pg, runtime_env, loading)
    finally:
        # also on failure: a driver process that exits frees its group with it, but an in-process
        # caller (the tests, a notebook) keeps its Ray connection, and the group's CPUs would starve the next run
        ray.util.remove_placement_group(pg)
    phases.mark("driver_end")
    if owns_ray:
        # now: left to the interpreter's exit it took 0.5 s longer (1.15 s against 0.68 s, measured),
        # and the job's end, which the launcher waits for, comes after it
        ray.shutdown()
    return 0


def _train_placed(args: Namespace, plan: BatchPlan, placement, pg, runtime_env, loading):
    """The run on its placement group: actors up, then per rollout generate -> train -> push."""
    import time
    from pathlib import Path

    import torch

    from miles.ray import faults, parity_drift
    from miles.records import checkpoint_identity as identity
    from miles.records.run_logging import MetricsLogger, Progress, init_wandb, log, plot_curves, save_image_grid, write_run_json
    from miles.backends.sft import SFTSource
    from miles.ray.rollout_manager import RolloutManager
    from miles.ray.checkpoint_saver import CheckpointSaver
    from miles.ray.train_actor_group import TrainActorGroup
    from miles.ray.weight_sync_group import connect_weight_sync

    trainer = None if args.debug_rollout_only else TrainActorGroup(args, plan, placement, pg, runtime_env)
    # sft_loss (--train-only): dataset items stand in for rollouts; no engines, no rewards, no weight pushes
    sft = args.loss_type == "sft_loss"
    rollout = SFTSource(args) if sft else RolloutManager(args, placement, pg, runtime_env,  # while the ranks set up
                                                         train_plan=None if trainer is None else plan)
    if trainer is not None:
        trainer.wait_ready()
    if trainer is not None and (lora := trainer.lora_spec()) is not None:
        rollout.apply_lora(lora, trainer.components())
    weights = connect_weight_sync(args, trainer, rollout) if trainer is not None and not sft else None
    phases.mark("actors_ready")

    start_id, resumed = args.start_rollout_id or 0, False
    found = (loading.checkpoint.rollout_id, loading.checkpoint.path) if loading.checkpoint is not None else None
    if found is not None:
        last_id, path = found
        log(identity.data_order_line(loading.checkpoint))
        if trainer is not None:
            trainer.load(str(path))
            if not sft:
                weights.push()  # the engines start from the loaded weights
        rollout.load_state_dict(torch.load(path / "driver.pt", weights_only=False)["rollout"])
        start_id = args.start_rollout_id if args.start_rollout_id is not None else last_id + 1
        resumed = True
    end_id = args.num_rollout or args.num_epoch * rollout.dataset.batches_per_epoch(args.rollout_batch_size)

    write_run_json(args.run_dir, sys.argv[1:], resumed=resumed, start_rollout_id=start_id, device=args.device,
                   extra=_load_record(args, loading))
    wandb_run = init_wandb(args, resume_id=loading.checkpoint.record.get("wandb_run_id") if found else None)
    wandb_id = getattr(wandb_run, "id", None)
    logger = MetricsLogger(args.run_dir, deterministic=args.deterministic_mode, start_rollout_id=start_id,
                           wandb_run=wandb_run)
    progress = Progress(start_id, end_id)
    log(f"training rollouts {start_id}..{end_id - 1} ({'resumed from ' + str(found[1]) if resumed else 'fresh'}); "
        f"run dir {args.run_dir}")
    phases.mark("loop_start")
    saver = CheckpointSaver(args, trainer, log)  # saves written in the background, committed when whole
    with saver.committed_on_failure():  # a failure still commits a save whose write ends
        for rollout_id in range(start_id, end_id):
            began = time.perf_counter()
            saver.poll()  # the train ranks are idle here: the previous save is committed if written
            faults.CURRENT_ROLLOUT[0] = rollout_id
            if args.debug_fault:
                faults.arm_for_rollout(args, rollout_id, trainer, rollout)
            metrics = {}
            if rollout_id == 0 and args.eval_interval and not args.skip_eval_before_train:
                # the initial weights' eval (miles-diffusion's default), kept apart from rollout 0's own eval
                metrics.update(as_before_train(rollout.evaluate(rollout_id)))
            batch, generated = rollout.generate(rollout_id)
            metrics.update(generated)
            before = parity_drift.digests_before_training(args.stop_on_parity_drift and not sft, trainer, rollout)
            if trainer is not None:
                metrics.update(trainer.train(batch)[0].metrics)
                del batch  # the last reference: the rollout's samples are freed where the engines keep them
                faults.check_finite(metrics, rollout_id)  # before the weights move on or get saved
                if not sft and rollout_id != args.debug_skip_weight_update_at:
                    metrics.update(weights.push())
            if args.eval_interval and (rollout_id + 1) % args.eval_interval == 0:
                metrics.update(rollout.evaluate(rollout_id))
            metrics["perf/step_time"] = time.perf_counter() - began
            logger.log_images(rollout_id, rollout.last_images, getattr(rollout, "last_captions", None),
                              count=args.wandb_log_num_images, interval=args.wandb_log_image_interval)
            logger.log(rollout_id, metrics)
            log(progress.line(rollout_id, metrics, metrics["perf/step_time"]))
            parity_drift.stop_on_drift(before, metrics, rollout_id)  # logged first: the record shows the reading
            last = rollout_id == end_id - 1
            if args.save and trainer is not None and (last or (args.save_interval and (rollout_id + 1) % args.save_interval == 0)):
                data_order = next(iter(rollout.state_dict().values()), None)
                saver.start(rollout_id, {"rollout": rollout.state_dict()},
                            identity.checkpoint_record(args, rollout_id, data_order, wandb_id))
    saver.wait()  # the run ends once its last save is committed

    phases.mark("loop_end")
    faults.CURRENT_ROLLOUT[0] = None
    logger.close()
    plot_curves(args.run_dir)
    save_image_grid(rollout.last_images, Path(args.run_dir) / "last_rollout.png",
                    captions=getattr(rollout, "last_captions", None))  # SFT: no images, no captions
    phases.mark("driver_outputs_written")
    rollout.shutdown()
    if trainer is not None:
        trainer.shutdown()


def refuse_foreign_checkpoints(args: Namespace):
    """A run never writes beside another run's checkpoints, never overwrites its own without being
    asked to resume them, and loads only a checkpoint trained with its training flags and data
    order (miles.records.checkpoint_identity; the launcher's preflight runs the same checks)."""
    from miles.records import checkpoint_identity as identity
    from miles.records.run_logging import log

    loading = identity.check_run_checkpoints(args)
    if loading.differences:
        log(f"WARNING: --load-anyway: loading {loading.checkpoint.path} despite other training flags: "
            f"{'; '.join(loading.differences)}")
    return loading


def _load_record(args: Namespace, loading) -> dict:
    """What run.json says about the checkpoint this run started from."""
    if loading.checkpoint is None:
        return {}
    return {"loaded_from": {"path": str(loading.checkpoint.path), "run_id": loading.checkpoint.record.get("run_id"),
                            "rollout_id": loading.checkpoint.rollout_id, "load_anyway": bool(args.load_anyway),
                            "flag_differences": loading.differences}}


def _job_ray_address() -> str | None:
    """Inside a Ray job the supervisor sets RAY_ADDRESS to its own cluster; naming it explicitly
    keeps Ray from announcing it ("Using address ... set in the environment variable"), which only
    matters when a user's own RAY_ADDRESS picks the cluster."""
    import os

    return os.environ.get("RAY_ADDRESS") if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ else None


if __name__ == "__main__":
    sys.exit(main())


def as_before_train(eval_metrics: dict[str, float]) -> dict[str, float]:
    """The initial weights' eval metrics, `eval/...` renamed `eval_before_train/...`: rollout 0's
    record may also carry the eval after its training step (--eval-interval 1)."""
    return {"eval_before_train/" + key.removeprefix("eval/"): value for key, value in eval_metrics.items()}
