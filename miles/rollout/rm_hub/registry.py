"""Which function scores a sample: built-ins by name, or a user's `module:fn` / `module.fn`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from miles.rollout.rm_hub.types import RewardError, RewardFn
from miles.utils.dotted_path import DottedPathError, load_callable
from miles.flags.reward_names import BUILTIN_REWARDS, CUSTOM


@lru_cache(maxsize=None)
def load_function(path: str) -> RewardFn:
    """`pkg.mod:fn` or `pkg.mod.fn` -> the function (the shared loader, errors as RewardError)."""
    try:
        return load_callable(path, what="reward")
    except DottedPathError as err:
        raise RewardError(str(err)) from err


def reward_name(args: Any, metadata: dict[str, Any]) -> str:
    """The reward of one sample: `metadata.rm_type`, else `--rm-type`, else `--custom-rm-path`.

    The name is a built-in, or a custom path (which is also how it appears in error messages).
    """
    name = metadata.get("rm_type") or getattr(args, "rm_type", None)
    custom = getattr(args, "custom_rm_path", None)
    if name in (None, CUSTOM):
        if not custom:
            raise RewardError("no reward configured: pass --rm-type or --custom-rm-path")
        return custom
    return name


def resolve(name: str) -> RewardFn:
    if name in BUILTIN_REWARDS:
        return load_function(BUILTIN_REWARDS[name])
    if ":" in name or "." in name:
        return load_function(name)
    raise RewardError(
        f"unknown reward {name!r}; built-ins are {', '.join(BUILTIN_REWARDS)}, "
        f"or give a custom function as 'module:fn'"
    )
