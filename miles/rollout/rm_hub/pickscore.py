"""`pickscore` reward: a CLIP-style model scores how well the image matches its prompt.

Loaded from `--pickscore-model-path`, a directory holding a `CLIPModel`, its tokenizer and
image processor (a released PickScore checkpoint, or the tiny one `miles.proxy_assets.pickscore`
builds from a seed for tests and CPU proxies); `--pickscore-processor-path` takes the tokenizer and
image processor from another folder (the released PickScore pairs with laion's CLIP-H processor).
Pairs are scored `--pickscore-batch-size` at a time. Score = logit_scale.exp() x cosine of the image and
text embeddings / `SCORE_SCALE`; a video scores the mean over a few frames.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np

from miles.rollout.rm_hub.types import RewardSample, frame_to_pil, pick_frames
from miles.flags.reward_names import EIGHT_BIT_FRAMES
from miles.utils.import_cost import collector_paused

# PickScore's raw logits sit near 20-23; dividing as Flow-GRPO does keeps rewards near [0, 1].
SCORE_SCALE = 26.0
VIDEO_FRAMES = EIGHT_BIT_FRAMES["pickscore"]
BATCH_SIZE = 32  # --pickscore-batch-size's default

_scorers: dict[tuple[str, str, int], "PickScoreScorer"] = {}
_scorers_lock = threading.Lock()


class PickScoreScorer:
    """A loaded CLIP model, tokenizer and image processor on one device."""

    def __init__(self, path: str | Path, device: str | None = None, processor_path: str | Path | None = None,
                 batch_size: int = BATCH_SIZE) -> None:
        with collector_paused():
            import torch
            from transformers import AutoTokenizer, CLIPModel

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no CLIP model at --pickscore-model-path {path} (config.json missing)")
        processor_path = Path(processor_path or path)
        if not (processor_path / "preprocessor_config.json").is_file():
            raise FileNotFoundError(f"no image processor at --pickscore-processor-path {processor_path} "
                                    "(preprocessor_config.json missing)")
        self.model = CLIPModel.from_pretrained(path).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(processor_path)
        self.processor = image_processor_class().from_pretrained(processor_path)
        self.processor_path = processor_path
        self.batch_size = batch_size
        self.max_length = min(int(self.model.config.text_config.max_position_embeddings), 77)

    def score_pairs(self, prompts: list[str], frames: list[np.ndarray]) -> list[float]:
        """Score frame i against prompt i, `batch_size` pairs per forward."""
        scores: list[float] = []
        for start in range(0, len(frames), self.batch_size):
            stop = start + self.batch_size
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


def get_scorer(path: str | Path, processor_path: str | Path | None = None,
               batch_size: int = BATCH_SIZE) -> PickScoreScorer:
    """One scorer per model, processor and batch size per process: loading is the expensive part."""
    key = (str(Path(path).resolve()), str(Path(processor_path or path).resolve()), batch_size)
    with _scorers_lock:
        if key not in _scorers:
            _scorers[key] = PickScoreScorer(path, processor_path=processor_path, batch_size=batch_size)
        return _scorers[key]


def frames_scored(args: Any) -> int:
    """Frames of a video PickScore reads: --pickscore-num-frames, else VIDEO_FRAMES."""
    return getattr(args, "pickscore_num_frames", None) or VIDEO_FRAMES


def score_samples_with(scorer: PickScoreScorer, samples: list[RewardSample], num_frames: int = VIDEO_FRAMES) -> list[float]:
    prompts, frames, owners = [], [], []
    for index, sample in enumerate(samples):
        for frame in pick_frames(sample.frames(), num_frames):
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

    processor_path = getattr(args, "pickscore_processor_path", None)
    batch_size = getattr(args, "pickscore_batch_size", None) or BATCH_SIZE

    def run() -> list[float]:
        return score_samples_with(get_scorer(path, processor_path, batch_size), samples, frames_scored(args))

    # Model calls block; a thread keeps the caller's event loop (an async actor) responsive.
    return await asyncio.to_thread(run)
