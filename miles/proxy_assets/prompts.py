"""Built-in prompt sets and a synthetic SFT dataset that recipes write in `prepare()`.

Nothing is downloaded: every file is generated from a seed, written to a temporary name and
renamed into place, and the same arguments give the same bytes, so two recipes (or two pytest
workers) preparing the same file at once cannot leave a torn or different one behind.
"""

from __future__ import annotations

import io
import json
import os
import random
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from miles.rollout.rm_hub.colors import COLORS

PROMPT_KINDS = ("tiny", "ocr", "general")

_TINY_TEMPLATES = (
    "a {color} square", "a plain {color} background", "a {color} ball", "a {color} wall",
    "a bright {color} light", "a {color} blanket", "a {color} sky",
)
_OCR_WORDS = (
    "HELLO", "WORLD", "OPEN", "STOP", "CAFE", "MILES", "SALE", "EXIT", "BOOK", "RAIN",
    "LOVE", "TAXI", "HOTEL", "PIZZA", "MUSIC", "DREAM", "SMILE", "OCEAN", "TIGER", "LIGHT",
)
_OCR_TEMPLATES = (
    'a sign that says "{word}"', 'a storefront with a neon sign reading "{word}"',
    'a t-shirt printed with the word "{word}"', 'a chalkboard with "{word}" written on it',
    'a coffee mug with the text "{word}"', 'a billboard showing the word "{word}"',
    'a wooden plaque engraved with "{word}"', 'a book cover titled "{word}"',
)
_SUBJECTS = (
    "a red fox", "an old lighthouse", "a bowl of ramen", "a vintage bicycle", "a snowy owl",
    "a glass teapot", "a mountain cabin", "a koi pond", "a steam locomotive", "a sunflower field",
    "a sleeping cat", "a hot air balloon", "a stone bridge", "a jazz trio", "a sailboat",
    "a desert cactus", "a city tram", "a paper lantern", "a humpback whale", "a bonsai tree",
)
_SETTINGS = (
    "at sunrise", "under a starry sky", "in the rain", "on a foggy morning", "in autumn",
    "at golden hour", "in a snowstorm", "by a calm lake", "in a busy market", "in a quiet forest",
)
_STYLES = (
    "photograph", "watercolor painting", "oil painting", "pencil sketch", "35mm film photo",
    "digital illustration", "studio photo with soft light", "isometric render",
)


def _cycled_records(num_prompts: int, rng: random.Random, values: Sequence[str], templates: Sequence[str],
                    field: str, metadata_key: str) -> list[dict[str, Any]]:
    """Cycle through `values` so every batch covers many of them; a random template varies the wording."""
    records = []
    for i in range(num_prompts):
        value = values[i % len(values)]
        prompt = rng.choice(templates).format(**{field: value})
        records.append({"prompt": prompt, "metadata": {metadata_key: value}})
    return records


def _tiny_records(num_prompts: int, rng: random.Random) -> list[dict[str, Any]]:
    return _cycled_records(num_prompts, rng, sorted(COLORS), _TINY_TEMPLATES, "color", metadata_key="color")


def _ocr_records(num_prompts: int, rng: random.Random) -> list[dict[str, Any]]:
    return _cycled_records(num_prompts, rng, _OCR_WORDS, _OCR_TEMPLATES, "word", metadata_key="text")


def _general_records(num_prompts: int, rng: random.Random) -> list[dict[str, Any]]:
    records = []
    for _ in range(num_prompts):
        prompt = f"{rng.choice(_SUBJECTS)} {rng.choice(_SETTINGS)}, {rng.choice(_STYLES)}"
        records.append({"prompt": prompt, "metadata": {}})
    return records


_GENERATORS: dict[str, Callable[[int, random.Random], list[dict[str, Any]]]] = {
    "tiny": _tiny_records, "ocr": _ocr_records, "general": _general_records,
}


def prompt_records(kind: str, num_prompts: int, seed: int = 0) -> list[dict[str, Any]]:
    """The records `ensure_prompt_file` writes, as dicts."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown prompt kind {kind!r}; choose one of {', '.join(PROMPT_KINDS)}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    return _GENERATORS[kind](num_prompts, random.Random(f"{kind}:{seed}"))


def _jsonl_bytes(records: list[dict[str, Any]]) -> bytes:
    lines = (json.dumps(r, sort_keys=True, ensure_ascii=False) for r in records)
    return "".join(line + "\n" for line in lines).encode("utf-8")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file and a rename; a file already equal is left alone."""
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_prompt_file(kind: str, path: str | Path, num_prompts: int, seed: int = 0) -> Path:
    """Write the built-in prompt set `kind` (`tiny`, `ocr`, `general`) as JSONL at `path`.

    `tiny`: colour prompts (metadata `color`) that the cheap rewards can teach a tiny model;
    `ocr`: prompts quoting a short word (metadata `text`); `general`: varied scene prompts.
    """
    path = Path(path)
    write_atomic(path, _jsonl_bytes(prompt_records(kind, num_prompts, seed)))
    return path


# --- synthetic SFT data -----------------------------------------------------------------------

_DIRECTIONS = ("horizontal", "vertical")


def _sft_prompt(direction: str, start: str, end: str, is_video: bool) -> str:
    prompt = f"a {direction} gradient from {start} to {end}"
    return prompt + ", drifting slowly" if is_video else prompt


def _gradient_frame(direction: str, start: str, end: str, height: int, width: int, phase: float | None):
    """`phase` None: a still gradient; else a triangle wave shifted by `phase` (no seam when it wraps)."""
    import numpy as np

    length = width if direction == "horizontal" else height
    t = np.arange(length, dtype=np.float64) / max(length - 1, 1)
    if phase is not None:
        t = 1.0 - np.abs(2.0 * ((t / 2.0 + phase) % 1.0) - 1.0)
    line = (1.0 - t)[:, None] * np.array(COLORS[start]) + t[:, None] * np.array(COLORS[end])
    if direction == "horizontal":
        image = np.broadcast_to(line[None, :, :], (height, width, 3))
    else:
        image = np.broadcast_to(line[:, None, :], (height, width, 3))
    return np.round(image * 255.0).astype(np.uint8)


def _png_bytes(pixels) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _sft_media(direction: str, start: str, end: str, height: int, width: int, frames: int) -> bytes:
    """One PNG: the image, or for video the frames side by side (frame f at columns f*W..(f+1)*W)."""
    import numpy as np

    strip = [_gradient_frame(direction, start, end, height, width, f / (2 * frames) if frames > 1 else None)
             for f in range(frames)]
    return _png_bytes(np.concatenate(strip, axis=1))


def _sft_paths(path: Path) -> tuple[Path, Path]:
    """(JSONL file, media folder): `path` may name the JSONL file or a folder to hold both."""
    if path.suffix == ".jsonl":
        return path, path.parent / f"{path.stem}_media"
    return path / "data.jsonl", path / "media"


def ensure_sft_dataset(
    path: str | Path, family: str, num_items: int, height: int, width: int, frames: int, seed: int = 0,
) -> Path:
    """A synthetic SFT set of gradients named by their prompt; returns the JSONL file.

    Each line is `{"prompt", "media", "height", "width", "frames"}` where `media` is a PNG path
    relative to the JSONL's folder; video families (`frames` > 1) store a frame strip, frame f
    at columns `f*width` to `(f+1)*width`. `path` is a `.jsonl` file (media beside it in
    `<stem>_media/`) or a folder (`data.jsonl` and `media/` inside).
    """
    from filelock import FileLock

    from miles.diffusion_facts.families import get_family_facts

    frames = frames if get_family_facts(family).is_video else 1
    if num_items < 1 or height < 1 or width < 1 or frames < 1:
        raise ValueError(f"bad SFT dataset size: items={num_items} {height}x{width}x{frames}")
    jsonl, media_dir = _sft_paths(Path(path))
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"sft:{family}:{seed}")
    colors = sorted(c for c in COLORS if c not in ("black", "white", "gray"))
    records = []
    with FileLock(str(jsonl) + ".lock"):
        for i in range(num_items):
            direction = rng.choice(_DIRECTIONS)
            start, end = rng.sample(colors, 2)
            media = media_dir / f"{i:05d}.png"
            write_atomic(media, _sft_media(direction, start, end, height, width, frames))
            records.append({"prompt": _sft_prompt(direction, start, end, frames > 1),
                            "media": media.relative_to(jsonl.parent).as_posix(),
                            "height": height, "width": width, "frames": frames})
        # The JSONL goes last so that its presence means every media file is in place.
        write_atomic(jsonl, _jsonl_bytes(records))
    return jsonl
