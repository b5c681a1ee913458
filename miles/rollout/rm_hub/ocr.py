"""`ocr` reward: does the image show the text the prompt quotes?

The recogniser is RapidOCR with the ONNX models that ship inside `rapidocr-onnxruntime`, so
nothing is downloaded. Score = 1 - normalised edit distance between what it reads and the
quoted text, case- and whitespace-insensitive; a video scores the mean over a few frames.

A frame whose shorter side is at most `SOFT_READ_MAX_SIDE` pixels (the CPU proxies' 64 px
samples) is scored differently: in a small model's samples at that size the text detector finds
no line at all (none in the tiny sd3's), so an edit distance scores every sample 0 and trains
nothing. It is scored by a soft read instead: the
recogniser reads the whole frame as one text line, and the score is the mean, over the target's
characters, of the highest probability the recogniser gives that character (either case)
anywhere in the line. Still an OCR reward from the same model, but dense: letter-like strokes of
the right letters raise it, which a tiny model can learn.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import numpy as np

from miles.rollout.rm_hub.types import RewardSample, frame_to_pil, pick_frames
from miles.flags.reward_names import EIGHT_BIT_FRAMES

VIDEO_FRAMES = EIGHT_BIT_FRAMES["ocr"]  # frames of a video that are read; OCR is the slow part of a rollout on CPU
SOFT_READ_MAX_SIDE = 128

_QUOTES = (re.compile(r'"([^"]+)"'), re.compile(r"“([^”]+)”"), re.compile(r"(?<!\w)'([^']+)'(?!\w)"))
_engine = None
_engine_lock = threading.Lock()


def quoted_text(prompt: str) -> str | None:
    """The first quoted span of a prompt: "..." or “...” or '...'."""
    for pattern in _QUOTES:
        match = pattern.search(prompt)
        if match:
            return match.group(1)
    return None


def target_text(sample: RewardSample) -> str:
    text = sample.metadata.get("text") or quoted_text(sample.prompt)
    if not text or not _normalise(text):
        raise ValueError('the ocr reward needs text to look for: quote it in the prompt (a sign that says "HELLO") '
                         "or give metadata['text']")
    return text


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _normalise(text: str) -> str:
    return "".join(text.lower().split())


def text_score(recognised: str, target: str) -> float:
    """1 - edit distance / len(target), floored at 0, after lower-casing and dropping whitespace."""
    recognised, target = _normalise(recognised), _normalise(target)
    return 1.0 - min(edit_distance(recognised, target), len(target)) / len(target)


def _get_engine():
    global _engine
    if _engine is None:
        from rapidocr_onnxruntime import RapidOCR

        _engine = RapidOCR()
    return _engine


def read_text(frame: np.ndarray) -> str:
    """All text RapidOCR finds in one `[3, H, W]` frame, lines in reading order, space-joined."""
    with _engine_lock:  # one engine per process; its calls are not re-entrant
        result, _ = _get_engine()(frame_to_pil(frame))
    if not result:
        return ""
    boxes = sorted(result, key=lambda r: (min(p[1] for p in r[0]), min(p[0] for p in r[0])))
    return " ".join(r[1] for r in boxes)


def line_probabilities(frame: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The recogniser's per-position character probabilities `[T, C]` for the whole frame read
    as one line, and its alphabet (index 0 is the CTC blank)."""
    recogniser = _get_engine().text_rec
    bgr = np.ascontiguousarray(np.asarray(frame_to_pil(frame))[:, :, ::-1])  # OpenCV's channel order
    _, line_h, line_w = recogniser.rec_image_shape
    ratio = max(line_w / line_h, bgr.shape[1] / bgr.shape[0])
    batch = recogniser.resize_norm_img(bgr, ratio)[np.newaxis].astype(np.float32)
    with _engine_lock:
        probabilities = recogniser.session(batch)[0][0]
    return probabilities, recogniser.postprocess_op.character


def soft_read_score(frame: np.ndarray, target: str) -> float:
    """Mean over the target's characters of their best probability in the line (module docstring)."""
    probabilities, alphabet = line_probabilities(frame)
    index = {char: i for i, char in enumerate(alphabet)}
    best = probabilities.max(axis=0)
    scores = []
    for char in _normalise(target):
        columns = [index[c] for c in {char, char.upper(), char.lower()} if c in index]
        scores.append(max((float(best[c]) for c in columns), default=0.0))
    return float(np.mean(scores))


def frame_score(frame: np.ndarray, target: str) -> float:
    if min(frame.shape[-2:]) <= SOFT_READ_MAX_SIDE:
        return soft_read_score(frame, target)
    return text_score(read_text(frame), target)


def ocr_score(sample: RewardSample) -> float:
    target = target_text(sample)
    frames = pick_frames(sample.frames(), VIDEO_FRAMES)
    return float(np.mean([frame_score(frame, target) for frame in frames]))


async def ocr_reward(args: Any, samples: list[RewardSample]) -> list[float]:
    # OCR blocks for a while; a thread keeps the caller's event loop (an async actor) responsive.
    return await asyncio.to_thread(lambda: [ocr_score(s) for s in samples])
