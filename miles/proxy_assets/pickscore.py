"""The tiny PickScore model of the CPU proxies: a CLIP of a few layers, random from a seed.

What `--pickscore-model-path` points to when a recipe runs below full scale; the reward that
loads it is `miles.rollout.rm_hub.pickscore`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from miles.proxy_assets import is_built_pickscore, tiny_pickscore_name
from miles.proxy_assets.prompts import PROMPT_KINDS, prompt_records
from miles.rollout.rm_hub.pickscore import image_processor_class

_SPECIALS = ("<pad>", "<bos>", "<unk>", "<eos>")  # eos id 3: CLIP pools at the eos token, found by id


def _vocabulary() -> list[str]:
    """Specials, then every word of the built-in prompt sets, letters and digits, in sorted order."""
    from tokenizers.pre_tokenizers import Whitespace

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
    image_processor_class()(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)


def ensure_tiny_pickscore(root: str | Path, seed: int = 0) -> Path:
    """`<root>/tiny-pickscore-seed<seed>`: a tiny CLIP, built once (under a file lock) and reused.

    Same seed, same bytes: built in a temporary folder and renamed into place when complete.
    """
    from filelock import FileLock

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = tiny_pickscore_name(seed)
    out = root / name
    with FileLock(str(root / f".{name}.lock")):
        if is_built_pickscore(out):
            return out
        tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            _write_tiny_pickscore(tmp, seed)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
