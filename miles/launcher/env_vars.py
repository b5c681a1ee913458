"""The environment a training job runs in: parsing --extra-env-vars, building the Ray runtime
env, and redacting secrets before anything is printed or written."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from miles.utils.numerics import job_numerics_env

REDACTED = "<redacted>"
DEFAULT_MASTER_ADDR = "127.0.0.1"
# Passed through from the launcher's environment: the socket interface a rank binds to must be
# the same one the operator chose, or NCCL/Gloo pick a different NIC per node.
# MILES_TEST_TOKEN: on a cluster the harness shares between runs, the job's driver and actors
# carry the run's own token, so the harness can tell (and end) exactly what one run left behind
_PASSTHROUGH_PREFIXES = ("NCCL_", "GLOO_", "MILES_PHASES_FILE", "MILES_TEST_TOKEN")
# cuBLAS only honours this if it is set before the process starts, so it cannot be left to the
# trainer's --deterministic-mode.
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# wandb's own conventions: the job sees what the user's shell set (the key never in argv or files).
WANDB_PASSTHROUGH = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR", "WANDB_BASE_URL")

# ---- the one secret rule: launcher, plan, logs and snapshots all use it ----
# A name is secret when one of its `_`-separated parts (trailing digits ignored) is one of these:
# WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, GITHUB_PAT, HF_TOKEN_READ, DB_PASSWORD_2 are secrets;
# PATH, KEYFRAMES, TOKENIZER_DIR, PATCH_SIZE are not. Names the rule misses: --secret-env NAME.
SECRET_NAME_PARTS = frozenset({
    "KEY", "KEYS", "APIKEY", "ACCESSKEY", "SECRETKEY", "PRIVATEKEY", "SECRET", "SECRETS", "TOKEN", "TOKENS",
    "AUTHTOKEN", "PASSWORD", "PASSWORDS", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "CREDS",
    "PAT", "AUTH", "PRIVATE", "COOKIE",
})
# ...or ends in one of these (PGPASSWORD, CLIENTSECRET, GHTOKEN): never an ordinary word's ending
SECRET_NAME_ENDINGS = ("PASSWORD", "PASSWD", "SECRET", "APIKEY", "TOKEN")
# A secret value shorter than this is not searched for as a substring (it would match everywhere).
MIN_SECRET_VALUE_LEN = 6
_extra_secret_names: set[str] = set()


class ExtraEnvVarsError(ValueError):
    """--extra-env-vars could not be parsed."""


def register_secret_names(names: Iterable[str]) -> None:
    """Names the rule misses (--secret-env): treated as secret from now on, in this process."""
    _extra_secret_names.update(n.strip().upper() for n in names if n and n.strip())


def parse_secret_env(text: str) -> list[str]:
    """--secret-env 'A B,C' -> ['A', 'B', 'C']; each must be a variable name."""
    names = [n for n in re.split(r"[\s,]+", text or "") if n]
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ExtraEnvVarsError(f"--secret-env: {name!r} is not a variable name; fix: give names like HF_TOKEN")
    return names


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    if upper in _extra_secret_names:
        return True
    parts = [part.rstrip("0123456789") for part in upper.split("_")]
    return any(p in SECRET_NAME_PARTS or p.endswith(SECRET_NAME_ENDINGS) for p in parts)


def secret_values(*envs: Mapping[str, str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-named variables in `envs` and the environment, longest first."""
    environ = os.environ if environ is None else environ
    found = {v for env in (environ, *envs) for k, v in env.items() if is_secret_name(k) and _searchable(v)}
    return sorted(found, key=len, reverse=True)


def _searchable(value: str) -> bool:
    # a mode word (RAY_AUTH_MODE=disabled) is not a secret to hunt for in every line
    return (len(value) >= MIN_SECRET_VALUE_LEN and value != REDACTED
            and not re.fullmatch(r"[a-z]+|[A-Z]+|\d{1,7}", value))


def redact_text(text: str, values: Iterable[str] | None = None) -> str:
    """`text` with every secret value (default: those in the environment) replaced by <redacted>."""
    for value in secret_values() if values is None else values:
        if value and _searchable(value):
            text = text.replace(value, REDACTED)
    return text


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Secret names get <redacted>; any other value has secret values inside it redacted."""
    values = secret_values(env)
    return {k: (REDACTED if is_secret_name(k) else redact_text(v, values)) for k, v in env.items()}


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
    repo_root: Path, extra_env: Mapping[str, str], environ: Mapping[str, str] | None = None, *, device: str
) -> dict[str, str]:
    """env_vars of the job's runtime env for a run on `device` (the train argv's --device);
    --extra-env-vars are applied last, so they win."""
    environ = os.environ if environ is None else environ
    # the repo root first, once: a launcher started with PYTHONPATH=<repo> gives the job the same path
    existing_path = ":".join(p for p in (environ.get("PYTHONPATH") or "").split(":") if p and p != str(repo_root))
    env = {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{repo_root}:{existing_path}" if existing_path else str(repo_root),
        "MASTER_ADDR": master_addr(environ),
    }
    env.update({k: v for k, v in sorted(environ.items()) if k.startswith(_PASSTHROUGH_PREFIXES)})
    env.update({k: environ.get(k, v) for k, v in DETERMINISM_ENV.items()})
    env.update(fixed_job_env(environ, device))
    env.update({k: environ[k] for k in WANDB_PASSTHROUGH if environ.get(k)})
    env.update(extra_env)
    return env


def fixed_job_env(environ: Mapping[str, str], device: str) -> dict[str, str]:
    """Extra fixed variables every job gets (numerics pinning and the like): merge them here.
    Applied after the determinism defaults and before wandb and --extra-env-vars. The CPU
    numerics pins go to CPU jobs only; a GPU job gets the documented host thread count."""
    return job_numerics_env(device)


def cuda_core_dump_env(run_dir: str) -> dict[str, str]:
    """What ExecuteTrainConfig.cuda_core_dump adds to the job: CUDA writes a core dump of a kernel
    that faults, into the run directory (the large memory segments left out)."""
    return {
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
        "CUDA_COREDUMP_SHOW_PROGRESS": "1",
        "CUDA_COREDUMP_GENERATION_FLAGS": "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,"
                                          "skip_local_memory,skip_constbank_memory",
        "CUDA_COREDUMP_FILE": f"{run_dir}/cuda_coredump_%h.%p.%t",
    }
