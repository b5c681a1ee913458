"""Options every recipe shares (the base of each recipe's ScriptArgs) and run ids."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.launcher.env_vars import (
    ExtraEnvVarsError,
    parse_extra_env_vars,
    parse_secret_env,
    redact_env,
    redact_text,
    register_secret_names,
)
from miles.launcher.launch_mode import LaunchModeError, dry_run_switch, is_external_ray

REPO_ROOT = Path(__file__).resolve().parents[2]


def create_run_id() -> str:
    """`20261129-081254-3fa9c1`: sortable by start time, unique across concurrent launches."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DEFAULT_TRAIN_SCRIPT = "train_diffusion.py"


class ScriptOptionError(ValueError):
    """A shared script option is unusable; the message names the option and the fix."""


def check_run_id(run_id: str) -> str:
    """A run id is one path component: letters, digits, '.', '_', '-', not starting with '.' or '-'."""
    if not RUN_ID_PATTERN.fullmatch(run_id or "") or run_id in (".", ".."):
        raise ScriptOptionError(
            f"--run-id {run_id!r} is not a single path component; fix: use letters, digits, '.', '_' and '-' "
            f"only (it names <output-dir>/<run-id>), e.g. --run-id my-run-1"
        )
    return run_id


def check_extra_args_flags(extra_args: str) -> None:
    """Flags in --extra-args that train_diffusion.py does not know, caught before prepare() runs."""
    from miles.flags.arguments import build_parser, unrecognized_message
    from miles.flags.flag_vocabulary import NO_COUNTERPART

    known = set(build_parser().known_flags()) | set(NO_COUNTERPART)  # the launcher leaves those out
    unknown = [w for w in split_extra_args(extra_args) if w.startswith("--") and w.split("=", 1)[0] not in known]
    if unknown:
        raise ScriptOptionError(f"--extra-args: {unrecognized_message(unknown, sorted(known))} "
                                f"(python3 train_diffusion.py --help lists every flag)")


def split_extra_args(extra_args: str) -> list[str]:
    """--extra-args as words; an unclosed quote names the option whose value it opens."""
    try:
        return shlex.split(extra_args or "")
    except ValueError as err:
        words = (extra_args or "").split()
        opened = next((i for i in range(1, len(words) + 1) if _unbalanced(" ".join(words[:i]))), None)
        option = next((w for w in reversed(words[:(opened or 1) - 1]) if w.startswith("-")), None)
        where = f"the value of {option.split('=', 1)[0]} ({words[opened - 1]})" if option and opened else extra_args
        raise ScriptOptionError(f"--extra-args {extra_args!r}: {str(err).lower()} in {where}; fix: close the quote, "
                                f"e.g. --extra-args '--lr 5e-4'") from None


def _unbalanced(text: str) -> bool:
    try:
        shlex.split(text)
        return False
    except ValueError:
        return True


def _default_num_nodes() -> int:
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or 1)


def _redacted_extra_env_vars(text: str) -> str:
    """--extra-env-vars as the options table shows it: secret values hidden."""
    try:
        env = parse_extra_env_vars(text)
    except ExtraEnvVarsError:
        return "<not parsed: see the error below>"
    return shlex.join(f"{k}={v}" for k, v in redact_env(env).items()) or "''"


def check_script_counts(options) -> None:
    """A recipe's own int options by their names: a seed is >= 0, a count of rollouts, ranks or
    GPUs is >= 1; refused here, naming the recipe's flag, before train_diffusion.py sees what
    they became (a --train-ranks 0 would otherwise surface as --rollout-num-gpus)."""
    import dataclasses

    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name.endswith("seed") and value < 0:
            raise ScriptOptionError(f"{flag}: must be >= 0 (a seed), got {flag} {value}; fix: pick a seed >= 0")
        counts = f.name.startswith("num_") or f.name.endswith(("_ranks", "_gpus", "_nodes"))
        # a script whose own default is 0 means "0 picks my default" (miles-diffusion's NFT
        # scripts: `num_rollout: int = 0`, then `args.num_rollout or 100`): 0 is its value there
        least = 0 if f.default == 0 else 1
        if counts and value < least and f.name != "num_gpus_per_node":
            raise ScriptOptionError(f"{flag}: must be >= {least}, got {flag} {value}; "
                                    f"fix: give {flag} {least} or more")


@dataclass
class ExecuteTrainConfig:
    """Options every recipe shares; a recipe's ScriptArgs inherits them."""

    num_nodes: int = field(
        default_factory=_default_num_nodes,
        metadata={"help": "Nodes the job spans.", "default_help": "$SLURM_JOB_NUM_NODES or 1"},
    )
    cuda_visible_devices: str = field(
        default="",
        metadata={"help": "Physical GPUs for the local Ray head, e.g. 0,1 (empty: inherit CUDA_VISIBLE_DEVICES)."},
    )
    output_dir: str = field(
        default=str(REPO_ROOT / "logs"),
        metadata={"help": "Run directories (<output-dir>/<run-id>) and the launcher's records go here."},
    )
    extra_env_vars: str = field(
        default="",
        metadata={"help": "Extra env vars for the job: 'K=V K2=V2' or a JSON object.",
                  "display": _redacted_extra_env_vars},
    )
    extra_args: str = field(
        default="",
        metadata={"help": "train_diffusion.py flags appended last, so they override the recipe's.",
                  "display": lambda text: redact_text(text) or "''"},
    )
    run_id: str = field(
        default_factory=create_run_id,
        metadata={"help": "Names the run directory (one path component); naming an earlier run id reuses it.",
                  "default_help": "a fresh id per run"},
    )
    max_restarts: int = field(
        default=0,
        metadata={"help": "After a failure classified as infrastructure (an actor or node died, a deadline passed), "
                          "relaunch the same run id from its last committed checkpoint, up to this many times "
                          "(never after a deterministic failure: a bad flag, a NaN, a reward that raises)."},
    )
    keep_ray_logs: bool = field(
        default=False,
        metadata={"help": "Keep the Ray temp dir of this run's own head (Ray's session logs) when it ends; by default it "
                          "is removed on every exit (success, failure, Ctrl-C)."},
    )
    secret_env: str = field(
        default="",
        metadata={"help": "More variable names to treat as secrets (redacted everywhere), e.g. 'DB_URL MY_CERT'. "
                          "Names with a part KEY, SECRET, TOKEN, PASSWORD, PASSWD, CREDENTIAL(S), PAT, AUTH "
                          "or PRIVATE are secrets already."},
    )

    cuda_core_dump: bool = field(
        default=False,
        metadata={"help": "CUDA writes a core dump of a kernel that faults, to <run-dir>/cuda_coredump_<host>.<pid>.<time> "
                          "(the CUDA_COREDUMP_* variables in the job's environment)."},
    )

    def __post_init__(self) -> None:
        """Checks that need nothing but the options, so a bad one stops the launch before prepare()
        builds anything: exit status 2 and one line naming the fix."""
        try:
            register_secret_names(parse_secret_env(self.secret_env))
            check_run_id(self.run_id)
            check_script_counts(self)
            if int(self.max_restarts) < 0:
                raise ScriptOptionError(f"--max-restarts {self.max_restarts}: must be 0 or more")
            parse_extra_env_vars(self.extra_env_vars)
            dry_run_switch()
            is_external_ray()
            if str(getattr(self, "train_script", DEFAULT_TRAIN_SCRIPT)).endswith(DEFAULT_TRAIN_SCRIPT):
                check_extra_args_flags(self.extra_args)
        except (ScriptOptionError, ExtraEnvVarsError, LaunchModeError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
