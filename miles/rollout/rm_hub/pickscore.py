"""`pickscore` reward: a CLIP-style model scores how well the image matches its prompt.

Loaded from `--pickscore-model-path`, a directory holding a `CLIPModel`, its tokenizer and
image processor (a released PickScore checkpoint, or the tiny one `ensure_tiny_pickscore`
builds here from a seed for tests and CPU proxies). Score = logit_scale.exp() x cosine of the
image and text embeddings / `SCORE_SCALE`; a video scores the mean over a few frames.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import uuid
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
        self.processor = _image_processor_class().from_pretrained(path)
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


def _image_processor_class():
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


# --- the tiny CLIP built locally ----------------------------------------------------------------

_SPECIALS = ("<pad>", "<bos>", "<unk>", "<eos>")  # eos id 3: CLIP pools at the eos token, found by id


def _vocabulary() -> list[str]:
    """Specials, then every word of the built-in prompt sets, letters and digits, in sorted order."""
    from tokenizers.pre_tokenizers import Whitespace

    from miles.rollout.prompts import PROMPT_KINDS, prompt_records

    split = Whitespace()
    words = set("abcdefghijklmnopqrstuvwxyz0123456789")
    for kind in PROMPT_KINDS:
        for record in prompt_records(kind, 400, seed=0):
            words.update(piece for piece, _ in split.pre_tokenize_str(record["prompt"].lower()))
    for word in ("a", "horizontal", "vertical", "gradient", "from", "to", "drifting", "slowly", "photo", "of"):
        words.add(word)
    return list(_SPECIALS) + sorted(words - set(_SPECIALS))


def build_tiny_tokenizer():
    """A word-level CLIP-style tokenizer: lower-cased, `<bos> words <eos>`, padded with `<pad>`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(_vocabulary())}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=77)


def build_tiny_clip(seed: int, vocab_size: int):
    import torch
    from transformers import CLIPConfig, CLIPModel

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, pad_token_id=0, bos_token_id=1, eos_token_id=3)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=8)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CLIPModel(config).eval()


def _write_tiny_pickscore(out: Path, seed: int) -> None:
    tokenizer = build_tiny_tokenizer()
    build_tiny_clip(seed, len(tokenizer)).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _image_processor_class()(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)


def ensure_tiny_pickscore(root: str | Path, seed: int = 0) -> Path:
    """`<root>/tiny-pickscore-seed<seed>`: a tiny CLIP, built once (under a file lock) and reused.

    Same seed, same bytes: built in a temporary folder and renamed into place when complete.
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"tiny-pickscore-seed{seed}"
    with FileLock(str(root / f".tiny-pickscore-seed{seed}.lock")):
        if (out / "config.json").is_file():
            return out
        tmp = root / f".tiny-pickscore-seed{seed}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            _write_tiny_pickscore(tmp, seed)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
