"""The SFT dataset: `{"prompt", "media", "height", "width", "frames"}` JSONL lines, read as pixels.

`media` is a PNG path relative to the JSONL's folder (or absolute); a video is a frame strip,
frame f at columns `f*width..(f+1)*width` (what `miles.proxy_assets.prompts.ensure_sft_dataset`
writes). The driver walks the items in an order fixed by the seed (`SFTDataset`, with a
`state_dict` like `PromptDataset`'s so a resumed run draws what it would have drawn); a train
rank turns only its own items into pixel tensors (`load_pixels`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.utils.epochs import EpochCursor


class SFTDataError(ValueError):
    """An SFT file or item that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class SFTItem:
    prompt: str
    media: str  # absolute path of the PNG
    height: int
    width: int
    frames: int
    index: int  # position in the file, 0-based


def read_sft_file(path: str | Path, input_key: str = "prompt") -> list[SFTItem]:
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"{path}: SFT data file not found (--prompt-data)")
    items: list[SFTItem] = []
    for line_number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise SFTDataError(f"{where}: malformed JSON ({err.msg})") from None
        missing = [k for k in (input_key, "media", "height", "width") if k not in record]
        if missing:
            raise SFTDataError(f"{where}: missing {', '.join(missing)} (an SFT line is "
                               f'{{"{input_key}", "media", "height", "width", "frames"}})')
        media = Path(record["media"])
        media = media if media.is_absolute() else path.parent / media
        items.append(SFTItem(str(record[input_key]), str(media), int(record["height"]), int(record["width"]),
                             int(record.get("frames", 1)), len(items)))
    if not items:
        raise SFTDataError(f"{path}: no items in the file")
    return items


def load_pixels(item: SFTItem, is_video: bool) -> torch.Tensor:
    """One item as float pixels in [0, 1]: [3, H, W], or [F, 3, H, W] for a video family."""
    from PIL import Image

    try:
        with Image.open(item.media) as image:
            strip = np.asarray(image.convert("RGB"))
    except OSError as err:
        raise SFTDataError(f"item {item.index} ({item.prompt!r}): cannot read {item.media}: {err}") from None
    h, w = item.height, item.width
    if strip.shape[0] != h or strip.shape[1] != w * item.frames:
        raise SFTDataError(f"item {item.index}: {item.media} is {strip.shape[1]}x{strip.shape[0]} px, expected "
                           f"{w * item.frames}x{h} ({item.frames} frames of {w}x{h})")
    frames = torch.from_numpy(strip.copy()).float().div_(255.0).reshape(h, item.frames, w, 3).permute(1, 3, 0, 2)
    return frames if is_video else frames[0]


class SFTDataset(EpochCursor[SFTItem]):
    """Items over epochs, each epoch in an order fixed by `seed` and the epoch number."""

    order_salt = "sft:"
    error = SFTDataError

    def __init__(self, items: list[SFTItem], *, seed: int = 42, shuffle: bool = True, source: str = "<memory>"):
        if not items:
            raise SFTDataError(f"{source}: no items")
        self.items, self.seed, self.shuffle, self.source = list(items), seed, shuffle, source
        self._start_epoch(0)

    @classmethod
    def from_args(cls, args: Any) -> "SFTDataset":
        """`--prompt-data` items, shuffled with `--rollout-seed` under `--rollout-shuffle`."""
        if not getattr(args, "prompt_data", None):
            raise SFTDataError("no SFT data: pass --prompt-data with a JSONL of SFT items")
        items = read_sft_file(args.prompt_data, getattr(args, "input_key", None) or "prompt")
        return cls(items, seed=getattr(args, "rollout_seed", 42), shuffle=bool(getattr(args, "rollout_shuffle", False)),
                   source=str(args.prompt_data))

