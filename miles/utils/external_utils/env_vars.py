"""The environment a training job runs in: parsing --extra-env-vars, building the Ray runtime
env, and redacting secrets before anything is printed or written."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

REDACTED = "<redacted>"
DEFAULT_MASTER_ADDR = "127.0.0.1"
# Passed through from the launcher's environment: the socket interface a rank binds to must be
# the same one the operator chose, or NCCL/Gloo pick a different NIC per node.
_PASSTHROUGH_PREFIXES = ("NCCL_", "GLOO_")
# cuBLAS only honours this if it is set before the process starts, so it cannot be left to the
# trainer's --deterministic-mode.
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
_SECRET_NAME = re.compile(r"(API_KEY|SECRET|PASSWORD|PASSWD|(^|_)TOKEN)$", re.IGNORECASE)


class ExtraEnvVarsError(ValueError):
    """--extra-env-vars could not be parsed."""


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_name(k) else v) for k, v in env.items()}


def parse_extra_env_vars(text: str) -> dict[str, str]:
    """`{"K": "V"}` (JSON object) or `K=V K2="a b"` (shell words) -> dict."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        return _parse_json_env(text)
    return _parse_assignments(text)


def _parse_json_env(text: str) -> dict[str, str]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        raise ExtraEnvVarsError(f"--extra-env-vars is not valid JSON ({err.msg} at char {err.pos}): {text!r}") from None
    if not isinstance(parsed, dict):
        raise ExtraEnvVarsError(f"--extra-env-vars JSON must be an object of NAME: value, got {type(parsed).__name__}")
    for name in parsed:
        _check_name(name, text)
    return {name: _json_value_to_str(value) for name, value in parsed.items()}


def _json_value_to_str(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return value if isinstance(value, str) else json.dumps(value)


def _parse_assignments(text: str) -> dict[str, str]:
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise ExtraEnvVarsError(f"--extra-env-vars: {err} in {text!r}") from None
    env: dict[str, str] = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not sep:
            raise ExtraEnvVarsError(
                f"--extra-env-vars: {word!r} is not NAME=VALUE; use 'K=V K2=V2' or a JSON object"
            )
        _check_name(name, text)
        env[name] = value
    return env


def _check_name(name: str, text: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ExtraEnvVarsError(f"--extra-env-vars: {name!r} is not a valid variable name (in {text!r})")


def master_addr(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR


def build_job_env_vars(
    repo_root: Path, extra_env: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """env_vars of the job's runtime env; --extra-env-vars are applied last, so they win."""
    environ = os.environ if environ is None else environ
    existing_path = environ.get("PYTHONPATH")
    env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{repo_root}:{existing_path}" if existing_path else str(repo_root),
        "MASTER_ADDR": master_addr(environ),
    }
    env.update({k: v for k, v in sorted(environ.items()) if k.startswith(_PASSTHROUGH_PREFIXES)})
    env.update({k: environ.get(k, v) for k, v in DETERMINISM_ENV.items()})
    if environ.get("WANDB_API_KEY"):
        env["WANDB_API_KEY"] = environ["WANDB_API_KEY"]
    env.update(extra_env)
    return env
