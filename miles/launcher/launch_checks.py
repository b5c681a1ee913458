"""What a launch checks before it fetches anything, and which train script it runs.

Order (each refusal is one line, exit 2): the train script (it exists, or is miles-diffusion's name
for ours); the assembled argv through train_diffusion.py's own parser and rules, the batch
arithmetic included; --load and --save (the checkpoints' run identity); a multi-node head's
address; the GPU layout against this machine. None needs a checkpoint or a prompt file, so
prepare()'s downloads (miles.launcher.deferred_fetches) wait until all pass.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from dataclasses import dataclass
from pathlib import Path

from miles.launcher.config import DEFAULT_TRAIN_SCRIPT, REPO_ROOT, ExecuteTrainConfig

# miles-diffusion's train scripts by name: what runs here instead (None: refused, the reason)
UPSTREAM_TRAIN_SCRIPTS: dict[str, tuple[str | None, str]] = {
    "train_sft.py": (DEFAULT_TRAIN_SCRIPT, "miles-diffusion's SFT entry point; SFT here is train_diffusion.py "
                                           "--loss-type sft_loss --train-only, which its SFT recipes pass"),
    "train_diffusion_async.py": (None, "miles-diffusion's one-step-off-policy (async) trainer does not run here: "
                                       "train_diffusion.py alternates rollout and training, each rollout sampled "
                                       "on the weights just trained; fix: drop train_script=... (the default "
                                       "train_diffusion.py)"),
}


class TrainScriptError(ValueError):
    """A train script that does not exist or does not run here; one line."""


@dataclass(frozen=True)
class TrainScript:
    path: Path  # what the job runs
    ours: bool  # train_diffusion.py: its flags are checked by its own parser
    mapped_from: str | None = None  # miles-diffusion's name it was given as


def resolve_train_script(train_script: str) -> TrainScript:
    given = Path(train_script)
    path = given if given.is_absolute() else REPO_ROOT / given
    ours = REPO_ROOT / DEFAULT_TRAIN_SCRIPT
    if path == ours:
        return TrainScript(path, True)
    if not path.is_file() and given.name in UPSTREAM_TRAIN_SCRIPTS:
        runs, why = UPSTREAM_TRAIN_SCRIPTS[given.name]
        if runs is None:
            raise TrainScriptError(f"train_script={train_script}: {why}")
        return TrainScript(ours, True, mapped_from=f"{train_script} -> {runs} ({why})")
    if not path.is_file():
        raise TrainScriptError(f"train_script={train_script}: no such file ({path}); fix: name a script that exists, "
                               f"or leave the default {DEFAULT_TRAIN_SCRIPT}")
    return TrainScript(path, False)


def parse_train_argv(argv: list[str]):
    """train_diffusion.py's parser and rules over `argv` in this process: (namespace, batch plan),
    or TrainArgvError with train_diffusion.py's own message."""
    from miles.flags.arguments import parse_and_plan
    from miles.launcher.launch_errors import TrainArgvError

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_and_plan(argv)
    except SystemExit:  # argparse: unknown flag or bad value; its last line is the reason
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        reason = lines[-1] if lines else "rejected by train_diffusion.py's parser"
        raise TrainArgvError(f"{reason} (in the assembled train argv: check the recipe and --extra-args)") from None
    except ValueError as err:  # ConfigError: a rule between flags
        raise TrainArgvError(f"train_diffusion.py: error: {err}") from None


def check_before_fetch(argv: list[str], config: ExecuteTrainConfig, num_gpus_per_node: int, *, dry: bool,
                       external: bool) -> None:
    """Every check that needs no asset, on the argv as it stands before hub ids become snapshots."""
    from miles.launcher import preflight
    from miles.launcher.env_vars import master_addr
    from miles.launcher.multinode import LoopbackHeadError, check_head_address
    from miles.launcher.launch_errors import LaunchError

    _refuse_foreign_checkpoint(argv)
    ns, _ = parse_train_argv(argv)
    try:
        preflight.check_checkpoints(ns, None)
    except preflight.PreflightError as err:  # recorded beside whatever the run dir already holds
        preflight.write_refusal(ns.run_dir, str(err), shlex.join(argv))
        raise LaunchError(str(err)) from None
    if dry or external:
        return  # a dry run notes a loopback head in its plan; an external cluster is checked as it is submitted to
    try:
        check_head_address(config.num_nodes, master_addr())
    except LoopbackHeadError as err:
        raise LaunchError(str(err)) from None
    if config.num_nodes == 1:
        _check_layout_fits_this_machine(ns, num_gpus_per_node, config.cuda_visible_devices)


def _refuse_foreign_checkpoint(argv: list[str]) -> None:
    from miles.launcher.flags import flag_values
    from miles.launcher.released_assets import foreign_checkpoint
    from miles.launcher.launch_errors import LaunchError

    value = flag_values(argv).get("--hf-checkpoint", "")
    why = foreign_checkpoint(value) if value else None
    if why:
        raise LaunchError(f"--hf-checkpoint {value}: {why}; nothing was fetched; fix: a checkpoint of one of this "
                          f"project's families (python3 train_diffusion.py --help lists them)")


def _check_layout_fits_this_machine(ns, num_gpus_per_node: int, cuda_visible_devices: str) -> None:
    """The cluster a single-node launch starts is this machine as its head declares it."""
    from miles.launcher.ray_cluster import (
        cpu_job_num_cpus, declared_gpus, layout_verdict, this_machine, visible_gpus,
    )
    from miles.launcher.launch_errors import LaunchError

    gpus = visible_gpus(cuda_visible_devices)
    verdict = layout_verdict(ns, this_machine(declared_gpus(num_gpus_per_node, gpus), cpu_job_num_cpus(num_gpus_per_node)))
    if verdict.never:
        raise LaunchError(f"this machine cannot run the recipe's layout: {verdict.reason} ({gpus.how}); fix: run it "
                          f"where the resources are, or pick a smaller --scale")
