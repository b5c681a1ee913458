"""`pickscore` reward: a CLIP-style model scores how well the image matches its prompt.

Loaded from `--pickscore-model-path`, a directory holding a `CLIPModel`, its tokenizer and
image processor (a released PickScore checkpoint, or the tiny one `miles.proxy_assets.pickscore`
builds from a seed for tests and CPU proxies). Score = logit_scale.exp() x cosine of the image and
text embeddings / `SCORE_SCALE`; a video scores the mean over a few frames.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np

from miles.rollout.rm_hub.types import RewardSample, frame_to_pil, pick_frames

# PickScore's raw logits sit near 20-23; dividing as Flow-GRPO does keeps rewards near [0, 1].
SCORE_SCALE = 26.0
VIDEO_FRAMES = 4
BATCH_SIZE = 32

_scorers: dict[tuple[str, str], "PickScoreScorer"] = {}
_scorers_lock = threading.Lock()


class PickScoreScorer:
    """A loaded CLIP model, tokenizer and image processor on one device."""

    def __init__(self, path: str | Path, device: str | None = None) -> None:
        import torch
        from transformers import AutoTokenizer, CLIPModel

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no CLIP model at --pickscore-model-path {path} (config.json missing)")
        self.model = CLIPModel.from_pretrained(path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = image_processor_class().from_pretrained(path)
        self.max_length = min(int(self.model.config.text_config.max_position_embeddings), 77)

    def score_pairs(self, prompts: list[str], frames: list[np.ndarray]) -> list[float]:
        """Score frame i against prompt i."""
        scores: list[float] = []
        for start in range(0, len(frames), BATCH_SIZE):
            stop = start + BATCH_SIZE
            scores.extend(self._score_batch(prompts[start:stop], frames[start:stop]))
        return scores

    def _score_batch(self, prompts: list[str], frames: list[np.ndarray]) -> list[float]:
        import torch

        images = self.processor(images=[frame_to_pil(f) for f in frames], return_tensors="pt")
        text = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            out = self.model(input_ids=text["input_ids"].to(self.device),
                             attention_mask=text["attention_mask"].to(self.device),
                             pixel_values=images["pixel_values"].to(self.device))
            cosine = (out.image_embeds * out.text_embeds).sum(-1)  # both come back L2-normalised
            scores = self.model.logit_scale.exp() * cosine / SCORE_SCALE
        return scores.float().cpu().tolist()


def image_processor_class():
    # transformers 5 names the PIL implementation apart and warns when torchvision is missing.
    try:
        from transformers import CLIPImageProcessorPil as processor_class
    except ImportError:
        from transformers import CLIPImageProcessor as processor_class
    return processor_class


def get_scorer(path: str | Path) -> PickScoreScorer:
    """One scorer per model path per process: loading is the expensive part."""
    key = (str(Path(path).resolve()), "auto")
    with _scorers_lock:
        if key not in _scorers:
            _scorers[key] = PickScoreScorer(path)
        return _scorers[key]


def score_samples_with(scorer: PickScoreScorer, samples: list[RewardSample]) -> list[float]:
    prompts, frames, owners = [], [], []
    for index, sample in enumerate(samples):
        for frame in pick_frames(sample.frames(), VIDEO_FRAMES):
            prompts.append(sample.prompt)
            frames.append(frame)
            owners.append(index)
    per_frame = np.asarray(scorer.score_pairs(prompts, frames))
    owners_arr = np.asarray(owners)
    return [float(per_frame[owners_arr == i].mean()) for i in range(len(samples))]


async def pickscore_reward(args: Any, samples: list[RewardSample]) -> list[float]:
    path = getattr(args, "pickscore_model_path", None)
    if not path:
        raise ValueError("the pickscore reward needs --pickscore-model-path")

    def run() -> list[float]:
        return score_samples_with(get_scorer(path), samples)

    # Model calls block; a thread keeps the caller's event loop (an async actor) responsive.
    return await asyncio.to_thread(run)
