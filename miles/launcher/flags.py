"""The trainer's argv: recipe flags, then --extra-args last, and locked flags that --extra-args
may not override."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping


class LockedFlagError(ValueError):
    """--extra-args tried to change a flag the recipe locked."""


def split_args(text: str) -> list[str]:
    return shlex.split(text or "")


def assemble_argv(run_dir: str, train_args: str, extra_args: str) -> list[str]:
    """`--run-dir` first, the recipe's flags, then --extra-args last: for a flag given twice the
    later one wins, which is what lets --extra-args override the recipe."""
    return ["--run-dir", str(run_dir), *split_args(train_args), *split_args(extra_args)]


def flag_values(argv: list[str]) -> dict[str, str]:
    """`--flag v1 v2` / `--flag=v` / `--switch` -> {flag: "v1 v2" | "v" | ""}; later wins."""
    values: dict[str, str] = {}
    current = None
    for word in argv:
        if word.startswith("--"):
            name, sep, value = word.partition("=")
            values[name] = value if sep else ""
            current = None if sep else name
        elif current is not None:
            values[current] = f"{values[current]} {word}".strip()
    return values


def locked_flag_values(
    train_args: str, locked_flags: Iterable[str] | Mapping[str, str] | None
) -> dict[str, str | None]:
    """The recipe's value of each locked flag (None when the recipe leaves it at its default)."""
    if not locked_flags:
        return {}
    recipe_values = flag_values(split_args(train_args))
    return {_normalise(flag): recipe_values.get(_normalise(flag)) for flag in locked_flags}


def check_locked_flags(extra_args: str, locked: Mapping[str, str | None]) -> None:
    overridden = [flag for flag in flag_values(split_args(extra_args)) if flag in locked]
    if not overridden:
        return
    flag = overridden[0]
    recipe_value = locked[flag]
    shown = "its default" if recipe_value is None else (repr(recipe_value) if recipe_value else "set (a switch)")
    raise LockedFlagError(
        f"{flag} is locked by this recipe (recipe value: {shown}) and --extra-args may not override it. "
        f"To change it, edit the recipe (its flag blocks and locked_flags), not --extra-args."
    )


def _normalise(flag: str) -> str:
    return flag if flag.startswith("--") else f"--{flag}"
