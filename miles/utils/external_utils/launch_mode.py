"""The environment switches that change what the launcher does."""

from __future__ import annotations

import os

DRY_RUN_ENV = "MILES_SCRIPT_ENABLE_RAY_SUBMIT"
EXTERNAL_RAY_ENV = "MILES_SCRIPT_EXTERNAL_RAY"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
DEFAULT_JOB_SERVER = "http://127.0.0.1:8265"


def is_dry_run() -> bool:
    """True with MILES_SCRIPT_ENABLE_RAY_SUBMIT=0: show everything, start and write nothing else."""
    return os.environ.get(DRY_RUN_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def is_external_ray() -> bool:
    """True with MILES_SCRIPT_EXTERNAL_RAY=1: a cluster exists; only submit to it."""
    return os.environ.get(EXTERNAL_RAY_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def external_job_server() -> str:
    address = os.environ.get(RAY_ADDRESS_ENV) or DEFAULT_JOB_SERVER
    return address if "://" in address else f"http://{address}"
