"""Stand-in text encoders that let StableDiffusion3Pipeline load and encode for a one-CLIP SD3.

Our tiny SD3 checkpoints have one CLIP and no T5; the pipeline's constructor requires all three
encoders and its encode_prompt always runs two CLIPs. Training conditioned on exactly what the
pipeline computes when the missing encoders add nothing, so the export carries encoders that add
nothing, by construction rather than by trained weights:
  text_encoder_2: a CLIP with a zero-width projection: its pooled output is 0 wide, and the
      pipeline's pad of the joined CLIP states to the joint width crops its hidden states away;
  text_encoder_3: a one-layer T5 whose final norm has weight 0: its output is exactly zero, the
      zero T5 slot training appended.
The tokenizers are the base's own. Seeded, so an export's bytes do not vary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

STAND_INS = ("text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")


def needs_stand_ins(family: str, base: Path) -> bool:
    index = json.loads((base / "model_index.json").read_text())
    return family == "sd3" and "text_encoder_2" not in index and "text_encoder_3" not in index


def write_stand_ins(out: Path, base: Path, index: dict) -> dict:
    """Write the stand-ins under `out`; returns `index` with them named."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the export's output is its one line
    clip = json.loads((base / "text_encoder" / "config.json").read_text())
    joint = json.loads((base / "transformer" / "config.json").read_text())["joint_attention_dim"]
    torch.manual_seed(0)
    config = transformers.CLIPTextConfig(**{**_clip_fields(clip), "projection_dim": 0})
    transformers.CLIPTextModelWithProjection(config).save_pretrained(out / "text_encoder_2")
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=clip["vocab_size"], d_model=joint, d_kv=8, d_ff=8, num_layers=1, num_heads=1,
        pad_token_id=clip.get("pad_token_id", 0), eos_token_id=clip.get("eos_token_id", 1)))
    with torch.no_grad():
        t5.encoder.final_layer_norm.weight.zero_()
    t5.save_pretrained(out / "text_encoder_3")
    for name in ("tokenizer_2", "tokenizer_3"):
        shutil.copytree(base / "tokenizer", out / name)
    return {**index, "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer_2": index["tokenizer"], "text_encoder_3": ["transformers", "T5EncoderModel"],
            "tokenizer_3": index["tokenizer"]}


def _clip_fields(config: dict) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")
    return {k: config[k] for k in keep if k in config}
