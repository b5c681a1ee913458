"""Downloads a recipe's prepare() asks for, run after the launch's checks.

A real launch checks everything that needs no asset (the train argv and its rules, the batch
arithmetic, the train script, --load/--save, multi-node addresses, the GPU layout against this
machine) before it fetches anything: a refused launch must not first pull tens of GB. So the
released assets a recipe names in prepare() are queued here and fetched by `execute_train` once
those checks pass; a dry run fetches nothing either way and only prints the commands.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable

from miles.launcher.launch_mode import is_dry_run

_PENDING: list[tuple[str, Callable[[], object]]] = []
_LAUNCHED: list[bool] = []  # a launch took the queue over (it runs it, or was refused before it)


def deferring() -> bool:
    """True in a real launch: fetches wait for the checks (a dry run prints its commands at once)."""
    return not is_dry_run()


def defer(what: str, fetch: Callable[[], object]) -> None:
    if not _PENDING:
        atexit.register(_fetch_if_nothing_launched)
    _PENDING.append((what, fetch))


def launching() -> None:
    """Called by execute_train: the queue is its to run, after its checks (or never, if refused)."""
    _LAUNCHED.append(True)


def _fetch_if_nothing_launched() -> None:
    """A prepare step of its own (`python3 run_x.py prepare-data`) launches nothing: its fetches
    still run, as the process ends."""
    if _LAUNCHED or not _PENDING:
        return
    from miles.launcher.asset_errors import AssetMissingError

    try:
        run_deferred()
    except AssetMissingError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def pending() -> list[str]:
    return [what for what, _ in _PENDING]


def run_deferred() -> None:
    """Run the queued fetches in the order prepare() asked for them."""
    while _PENDING:
        _, fetch = _PENDING.pop(0)
        fetch()
