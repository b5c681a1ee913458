"""The one `pkg.mod:fn` / `pkg.mod.fn` loader: rewards, step strategies and custom losses use it."""

from __future__ import annotations

import importlib
from typing import Any


class DottedPathError(ValueError):
    """The path is malformed, its module does not import, or it names no callable."""


def split_dotted_path(path: str) -> tuple[str, str]:
    """`pkg.mod:fn` -> ('pkg.mod', 'fn'); `pkg.mod.fn` -> ('pkg.mod', 'fn')."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise DottedPathError(f"{path!r} is not of the form 'pkg.mod:fn' or 'pkg.mod.fn'")
    return module_name, attr


def load_callable(path: str, what: str = "function") -> Any:
    """The callable `path` names; DottedPathError (one line, naming `what`) otherwise."""
    try:
        module_name, attr = split_dotted_path(path)
    except DottedPathError as err:
        raise DottedPathError(f"{what} {err}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DottedPathError(f"{what} {path!r}: cannot import module {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise DottedPathError(f"{what} {path!r}: module {module_name!r} has no function {attr!r}")
    return fn
