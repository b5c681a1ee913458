"""The environment switches that change what the launcher does, read fail-closed.

MILES_SCRIPT_ENABLE_RAY_SUBMIT (alias: ENABLE_RAY_SUBMIT) and MILES_SCRIPT_EXTERNAL_RAY accept
1/true/yes/on and 0/false/no/off (any case); any other value stops the launch with exit status 2,
so a typo can never turn a dry run into a real one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from urllib.parse import urlparse

from miles.launcher.typer_utils import parse_bool_word

DRY_RUN_ENV = "MILES_SCRIPT_ENABLE_RAY_SUBMIT"
DRY_RUN_ALIAS_ENV = "ENABLE_RAY_SUBMIT"
EXTERNAL_RAY_ENV = "MILES_SCRIPT_EXTERNAL_RAY"
EXTERNAL_ADDRESS_ENV = "MILES_SCRIPT_RAY_ADDRESS"  # the explicit address of an external cluster
RAY_ADDRESS_ENV = "RAY_ADDRESS"
# where the head's dashboard and job server listen; loopback unless set (jobs are submitted on the head)
DASHBOARD_HOST_ENV = "MILES_SCRIPT_RAY_DASHBOARD_HOST"
DEFAULT_JOB_SERVER = "http://127.0.0.1:8265"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
ACCEPTED = "1/true/yes/on or 0/false/no/off"


class LaunchModeError(ValueError):
    """A launcher switch or address is malformed; the message names the variable and the fix."""


def parse_switch(name: str, raw: str) -> bool:
    value = parse_bool_word(raw, TRUE_WORDS, FALSE_WORDS)
    if value is None:
        raise LaunchModeError(f"{name}={raw!r} is not a switch value; fix: use {ACCEPTED}")
    return value


def dry_run_switch(environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(dry run?, which variable decided: MILES_SCRIPT_ENABLE_RAY_SUBMIT, ENABLE_RAY_SUBMIT or 'default')."""
    environ = os.environ if environ is None else environ
    decided = {}
    for name in (DRY_RUN_ENV, DRY_RUN_ALIAS_ENV):
        raw = environ.get(name)
        if raw is not None and raw.strip():
            decided[name] = not parse_switch(name, raw)  # submit off = dry run
    if len(set(decided.values())) > 1:
        raise LaunchModeError(
            f"{DRY_RUN_ENV}={environ[DRY_RUN_ENV]!r} and {DRY_RUN_ALIAS_ENV}={environ[DRY_RUN_ALIAS_ENV]!r} "
            f"disagree; fix: unset one of them"
        )
    for name, dry in decided.items():
        return dry, name
    return False, "default"


def _or_exit(fn, *args):
    try:
        return fn(*args)
    except LaunchModeError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def is_dry_run() -> bool:
    """True with MILES_SCRIPT_ENABLE_RAY_SUBMIT=0 (or ENABLE_RAY_SUBMIT=0): show everything, start
    nothing. A value that is no switch value exits with status 2."""
    return _or_exit(dry_run_switch)[0]


def is_external_ray() -> bool:
    """True with MILES_SCRIPT_EXTERNAL_RAY=1: a cluster exists; only submit to it."""
    raw = os.environ.get(EXTERNAL_RAY_ENV, "")
    return bool(raw.strip()) and _or_exit(parse_switch, EXTERNAL_RAY_ENV, raw)


def external_address(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(job server URL, which variable gave it) for external mode: MILES_SCRIPT_RAY_ADDRESS, else
    RAY_ADDRESS, else the default local dashboard. The URL must be http(s)://host:port."""
    environ = os.environ if environ is None else environ
    for name in (EXTERNAL_ADDRESS_ENV, RAY_ADDRESS_ENV):
        raw = (environ.get(name) or "").strip()
        if raw:
            return check_job_server_url(name, raw), name
    return DEFAULT_JOB_SERVER, "default"


def check_job_server_url(name: str, raw: str) -> str:
    parsed = urlparse(raw)
    if parsed.scheme not in ("http", "https"):
        hint = (" (host:port without a scheme is what Ray reads as a GCS address)" if "://" not in raw else "")
        raise LaunchModeError(
            f"{name}={raw!r} is not a Ray job server URL{hint}; fix: give the dashboard address, "
            f"e.g. {name}=http://HOST:8265"
        )
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise LaunchModeError(f"{name}={raw!r} lacks a host or port; fix: e.g. {name}=http://HOST:8265")
    return raw.rstrip("/")


def dashboard_host(environ: Mapping[str, str] | None = None) -> str:
    """The address a head of ours binds its dashboard and job server to: 127.0.0.1 unless
    MILES_SCRIPT_RAY_DASHBOARD_HOST names another (0.0.0.0: every interface; the token guards it)."""
    environ = os.environ if environ is None else environ
    return (environ.get(DASHBOARD_HOST_ENV) or "").strip() or "127.0.0.1"


def external_job_server() -> str:
    return _or_exit(external_address)[0]


def check_reachable(url: str, name: str, timeout: float = 3.0) -> str:
    """The auth mode ('token' or 'disabled') the job server at `url` reports (Ray answers that
    without a token); raise LaunchModeError in one line unless it answers within `timeout`. A Ray
    without token auth (before 2.52) has no such endpoint: 'disabled'."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/authentication_mode", timeout=timeout) as resp:
            return str(json.loads(resp.read()).get("authentication_mode") or "disabled")
    except urllib.error.HTTPError as err:
        # something answers HTTP there: without the endpoint, a Ray that checks no token; anything
        # else is not ours to judge: Ray's own client reports what it dislikes, with the user's token
        return "disabled" if err.code == 404 else "token"
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise LaunchModeError(
            f"no Ray job server answers at {url} (from {name}) within {timeout:.0f}s: {reason}; fix: start the "
            f"cluster (ray start --head, with RAY_AUTH_MODE=token) or correct {name}"
        ) from None
