"""The one `pkg.mod:fn` / `pkg.mod.fn` loader: rewards, step strategies and custom losses use it."""

from __future__ import annotations

import importlib
from typing import Any

from miles.utils.import_cost import collector_paused


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
    with collector_paused():  # a model class's module imports its library's heavy half (miles.utils.import_cost)
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise DottedPathError(f"{what} {path!r}: cannot import module {module_name!r}: {err}") from err
        fn = getattr(module, attr, None)  # a lazy package imports the module here
    if not callable(fn):
        raise DottedPathError(f"{what} {path!r}: module {module_name!r} has no function {attr!r}")
    contract = RESULT_CONTRACTS.get(what)
    return fn if contract is None else _held_to(fn, path, what, *contract)


class CustomFunctionError(RuntimeError):
    """A user's function raised, or returned what its contract does not allow; names the flag and path."""


def _is_loss_and_metrics(result: Any) -> bool:
    return isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], dict)


# the flag whose function is called -> (its result is right, what it must return); the trainer unpacks
# the result, so a wrong one would otherwise end as "cannot unpack non-iterable float"
RESULT_CONTRACTS = {
    "--custom-loss-function-path": (_is_loss_and_metrics,
                                    "(loss, metrics): a scalar loss tensor to backpropagate and a dict of metrics"),
}


def _held_to(fn: Any, path: str, what: str, is_right: Any, must_return: str) -> Any:
    """`fn`, whose failures name the flag, the path and the contract (the user's traceback stays chained)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except Exception as err:
            raise CustomFunctionError(f"{what} {path} raised {type(err).__name__}: {err}; fix: that function "
                                      f"(its traceback is in the job log), which must return {must_return}") from err
        if not is_right(result):
            raise CustomFunctionError(f"{what} {path} returned a {type(result).__name__}; fix: return "
                                      f"{must_return}")
        return result

    call.__wrapped__ = fn
    return call
