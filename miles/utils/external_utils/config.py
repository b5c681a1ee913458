"""Options every recipe shares (the base of each recipe's ScriptArgs) and run ids."""

from __future__ import annotations

import os
import secrets
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.utils.external_utils.env_vars import ExtraEnvVarsError, parse_extra_env_vars, redact_env

REPO_ROOT = Path(__file__).resolve().parents[3]


def create_run_id() -> str:
    """`20261129-081254-3fa9c1`: sortable by start time, unique across concurrent launches."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _default_num_nodes() -> int:
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or 1)


def _redacted_extra_env_vars(text: str) -> str:
    """--extra-env-vars as the options table shows it: secret values hidden."""
    try:
        env = parse_extra_env_vars(text)
    except ExtraEnvVarsError:
        return "<not parsed: see the error below>"
    return shlex.join(f"{k}={v}" for k, v in redact_env(env).items()) or "''"


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
        metadata={"help": "train_diffusion.py flags appended last, so they override the recipe's."},
    )
    run_id: str = field(
        default_factory=create_run_id,
        metadata={"help": "Names the run directory; naming an earlier run id reuses its directory.",
                  "default_help": "a fresh id per run"},
    )
