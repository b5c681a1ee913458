"""Which function scores a sample: built-ins by name, or a user's `module:fn` / `module.fn`."""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from miles.rollout.rm_hub.types import RewardError, RewardFn

# Imported on first use so that asking for `brightness` never loads OCR or CLIP models.
BUILTIN_REWARDS: dict[str, str] = {
    "brightness": "miles.rollout.rm_hub.cheap:brightness",
    "color_match": "miles.rollout.rm_hub.cheap:color_match",
    "ocr": "miles.rollout.rm_hub.ocr:ocr_reward",
    "pickscore": "miles.rollout.rm_hub.pickscore:pickscore_reward",
}
CUSTOM = "custom"  # `rm_type` value that selects --custom-rm-path explicitly


@lru_cache(maxsize=None)
def load_function(path: str) -> RewardFn:
    """`pkg.mod:fn` or `pkg.mod.fn` -> the function."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardError(f"reward path {path!r} is not of the form 'module:fn' or 'module.fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"cannot import reward module {module_name!r} of {path!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {path!r}: module {module_name!r} has no function {attr!r}")
    return fn


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
