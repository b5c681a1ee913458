"""Which function scores a sample: built-ins by name, or a user's `module:fn` / `module.fn`."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from miles.rollout.rm_hub.types import RewardError, RewardFn
from miles.utils.dotted_path import DottedPathError, load_callable

# Imported on first use so that asking for `brightness` never loads OCR or CLIP models.
BUILTIN_REWARDS: dict[str, str] = {
    "brightness": "miles.rollout.rm_hub.cheap:brightness",
    "color_match": "miles.rollout.rm_hub.cheap:color_match",
    "ocr": "miles.rollout.rm_hub.ocr:ocr_reward",
    "pickscore": "miles.rollout.rm_hub.pickscore:pickscore_reward",
}
CUSTOM = "custom"  # `rm_type` value that selects --custom-rm-path explicitly
CUSTOM_CONTRACT = ("`async def rm(args, samples: list[RewardSample]) -> list[float]` (one score per sample; "
                   "sample.prompt, sample.image [3,H,W] or [F,3,H,W] in [0,1], sample.metadata; "
                   "dict scores need --reward-key)")


def rm_type(value: str) -> str:
    """argparse type of --rm-type: a built-in, 'custom', or a pkg.mod:fn path; else 'did you mean'."""
    import argparse
    import difflib

    if value in BUILTIN_REWARDS or value == CUSTOM or ":" in value:
        return value
    close = difflib.get_close_matches(value, [*BUILTIN_REWARDS, CUSTOM], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown reward {value!r}; {hint}built-ins: {', '.join(BUILTIN_REWARDS)}; or 'custom' with "
        f"--custom-rm-path pkg.mod:fn"
    )


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
