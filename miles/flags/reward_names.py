"""The rewards `--rm-type` can name, and the contract of a custom one.

Torch-free, so the flag parser can check `--rm-type` and name the choices without importing the
scorers; `miles.rollout.rm_hub.registry` resolves a name to its function.
"""

from __future__ import annotations

# Imported on first use so that asking for `brightness` never loads OCR or CLIP models.
BUILTIN_REWARDS: dict[str, str] = {
    "brightness": "miles.rollout.rm_hub.cheap:brightness",
    "color_match": "miles.rollout.rm_hub.cheap:color_match",
    "ocr": "miles.rollout.rm_hub.ocr:ocr_reward",
    "pickscore": "miles.rollout.rm_hub.pickscore:pickscore_reward",
}
# the rewards that read a video's frames as 8-bit pixels, and how many of its frames (first and last
# included, evenly spread): the engines send them only those (miles.rollout.rm_hub.wire)
EIGHT_BIT_FRAMES: dict[str, int] = {"pickscore": 4, "ocr": 4}
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
