"""Score one image with one reward: `python3 -m miles.rollout.rm_hub.score --rm-type R --prompt P --image FILE`.

For debugging a reward by hand. `--image` is a PNG/JPEG, a frame strip with `--frames N`
(frames side by side), or a `.npy` array `[3, H, W]` / `[F, 3, H, W]` in [0, 1]. Prints the reward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from miles.rollout.rm_hub.pool import LocalRewardScorer
from miles.flags.reward_names import BUILTIN_REWARDS, rm_type
from miles.rollout.rm_hub.types import RewardError, RewardSample


class _OneLineErrorParser(argparse.ArgumentParser):
    """A bad flag or value: one `error:` line on stderr, exit status 2 (no usage block)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog="python3 -m miles.rollout.rm_hub.score", description=__doc__.split("\n")[0])
    # the same check as train_diffusion.py's --rm-type (registry.rm_type): a misspelt name stops at parse time
    parser.add_argument("--rm-type", type=rm_type, metavar="NAME",
                        help=f"a built-in ({', '.join(BUILTIN_REWARDS)}) or 'custom' (with --custom-rm-path)")
    parser.add_argument("--custom-rm-path", help="module:fn of an `async def rm(args, samples) -> list[float]`")
    parser.add_argument("--reward-key", help="the key to read when the reward returns dicts")
    parser.add_argument("--pickscore-model-path", help="CLIP model directory for --rm-type pickscore")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--image", required=True, type=Path)
    parser.add_argument("--frames", type=int, default=1, help="split a PNG frame strip into this many frames")
    parser.add_argument("--metadata", type=json.loads, default={}, help='JSON object, e.g. \'{"text": "HELLO"}\'')
    parser.add_argument("--reward-timeout", type=float, default=300.0)
    return parser


def load_pixels(path: Path, frames: int = 1) -> np.ndarray:
    """`[3, H, W]` (or `[F, 3, H, W]`) float32 in [0, 1] from an image file or a `.npy` array."""
    if path.suffix == ".npy":
        pixels = np.load(path)
        return pixels.astype(np.float32) / 255.0 if pixels.dtype == np.uint8 else pixels.astype(np.float32)
    from PIL import Image

    hwc = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    chw = np.transpose(hwc, (2, 0, 1))
    if frames <= 1:
        return chw
    if chw.shape[2] % frames:
        raise ValueError(f"{path}: width {chw.shape[2]} does not split into {frames} frames")
    return np.stack(np.split(chw, frames, axis=2))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.rm_type and not args.custom_rm_path:
        print("error: pass --rm-type or --custom-rm-path", file=sys.stderr)
        return 2
    try:
        sample = RewardSample(args.prompt, load_pixels(args.image, args.frames), dict(args.metadata))
        (score,) = LocalRewardScorer(args).score([sample])
    except (RewardError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{score:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
