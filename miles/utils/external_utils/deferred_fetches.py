"""Downloads a recipe's prepare() asks for, run after the launch's checks.

A real launch checks everything that needs no asset (the train argv and its rules, the batch
arithmetic, the train script, --load/--save, multi-node addresses, the GPU layout against this
machine) before it fetches anything: a refused launch must not first pull tens of GB. So the
released assets a recipe names in prepare() are queued here and fetched by `execute_train` once
those checks pass; a dry run fetches nothing either way and only prints the commands.
"""

from __future__ import annotations

from collections.abc import Callable

from miles.utils.external_utils.launch_mode import is_dry_run

_PENDING: list[tuple[str, Callable[[], object]]] = []


def deferring() -> bool:
    """True in a real launch: fetches wait for the checks (a dry run prints its commands at once)."""
    return not is_dry_run()


def defer(what: str, fetch: Callable[[], object]) -> None:
    _PENDING.append((what, fetch))


def pending() -> list[str]:
    return [what for what, _ in _PENDING]


def run_deferred() -> None:
    """Run the queued fetches in the order prepare() asked for them."""
    while _PENDING:
        _, fetch = _PENDING.pop(0)
        fetch()
