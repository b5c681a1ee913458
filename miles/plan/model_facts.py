"""What the memory plans know of a checkpoint and a run's samples, from configs and flags alone. Torch-free.

Facts come from the checkpoint, never from its weights: on disk, each component folder's
safetensors headers (tensor shapes; a header is a few KiB at the start of the file) and
`config.json`; not on disk, the committed table of computed parameter counts
(`miles/plan/model_table.py`). A checkpoint in neither gets "estimate unavailable". The GPU plan
(miles.plan.memory_plan) and the host plan (miles.plan.host_plan) both read them here.
"""

from __future__ import annotations

import json
import math
import os
import struct
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

from miles.diffusion_facts.families import get_family_facts

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Geometry:
    """How a family's pixels become transformer tokens, and how the pipeline feeds text."""

    spatial: int  # VAE spatial compression
    temporal: int  # VAE temporal compression (1: images)
    patch: tuple[int, int, int]  # transformer patch (t, h, w)
    latent_channels: int
    joint_text: bool  # text tokens go through every block with the image tokens (MMDiT)
    decode_chunk_frames: int  # frames the VAE decodes at once (0: all)
    lora_linears_per_block: float  # LoRA adapter width per block, in units of hidden (r x this x hidden)
    # the VAE decoder's largest maps are at (height / this) x (width / this): LTX-2's decoder ends at a
    # quarter of the pixel grid (128 channels) and unpatchifies 4 x 4 pixels from there
    decode_stride: int = 1
    # width of one conditioning token as the transformer reads it (prompt embeddings; LTX-2: the video
    # and the audio streams' together), for the bytes a prompt group's conditioning takes
    text_dim: int = 4096


GEOMETRY = {
    "sd3": Geometry(8, 1, (1, 2, 2), 16, True, 0, 16.0),  # 8 linears (to_q/k/v/out, add_*) of hidden -> hidden
    "qwen_image": Geometry(8, 1, (1, 2, 2), 16, True, 0, 16.0, text_dim=3584),
    # Wan: two attentions (self, cross) + the FFN's two linears (ffn = 2.7 x hidden)
    "wan2_2": Geometry(8, 4, (1, 2, 2), 16, False, 4, 16.0 + 2 * (1 + 2.7)),
    "ltx": Geometry(32, 8, (1, 1, 1), 128, False, 0, 16.0),
    "cosmos3": Geometry(8, 4, (1, 2, 2), 16, False, 4, 8.0, text_dim=1024),
    # LTX-2: the video tokens counted (the audio stream, ~26 tokens a second at half the width, adds
    # about 1-2 % at the recipes' sizes); attention LoRA on its six attentions: two video-wide
    # (self, text), two audio-wide (half), the audio-video pair (between) -> 2 x 8 + 2 x 4 + 2 x 6
    "ltx2": Geometry(32, 8, (1, 1, 1), 128, False, 0, 36.0, decode_stride=4, text_dim=4096 + 2048),
}

@dataclass
class ComponentFacts:
    params: int
    blocks: int | None = None
    hidden: int | None = None


@dataclass
class ModelFacts:
    source: str  # "checkpoint on disk" or "committed table (<key>)"
    components: dict[str, ComponentFacts]


def part_bytes(family: str, part: str, dtype_bytes: int) -> int:
    """Bytes per parameter (or activation value) of `part` held in a `dtype_bytes` dtype: 4 for a part
    the family runs in float32 whatever the dtype (Wan's VAE; miles.models.loader.part_dtype)."""
    return 4 if get_family_facts(family).runs_in_float32(part) else dtype_bytes


def held_bytes(family: str, comps: dict[str, ComponentFacts], parts, dtype_bytes: int) -> float:
    """The bytes of `parts` held in a `dtype_bytes` dtype, each part by `part_bytes`."""
    return sum(comps[n].params * part_bytes(family, n, dtype_bytes) for n in parts)


# -- facts about the checkpoint --------------------------------------------------------------------

def safetensors_params(path: Path) -> int:
    """Parameter count from a .safetensors file's header alone (8-byte length + JSON)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def read_checkpoint(path: str | os.PathLike) -> ModelFacts | None:
    """Facts from a diffusers-layout checkpoint on disk (headers and configs only), or None."""
    root = Path(path)
    if not root.is_dir():
        return None
    components = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(sub.glob("*.safetensors"))
        if not files:
            continue
        facts = ComponentFacts(sum(safetensors_params(f) for f in files))
        config_path = sub / "config.json"
        if sub.name.startswith("transformer") and config_path.is_file():
            cfg = json.loads(config_path.read_text())
            heads, head_dim = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
            facts.hidden = heads * head_dim if heads and head_dim else cfg.get("dim")
            facts.blocks = cfg.get("num_layers")
        components[sub.name] = facts
    if not components:
        return None
    return ModelFacts("checkpoint on disk", components)


def _hub_repo_name(path: str) -> str | None:
    """`.../models--org--name/snapshots/<revision>` (the Hugging Face cache) -> `name`."""
    parts = Path(path.rstrip("/")).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return None


def _table_key(path: str) -> str | None:
    from miles.plan.model_table import load_table

    name = _hub_repo_name(path) or Path(path.rstrip("/")).name
    table = load_table()
    if name in table:
        return name
    for key in table:  # our own checkpoints: miles-<family>-<size>-seed<N>
        if key.startswith("miles-") and name.startswith(key + "-seed"):
            return key
    return None


def model_facts(path: str | None) -> ModelFacts | None:
    if not path:
        return None
    found = read_checkpoint(path)
    if found is not None:
        return found
    key = _table_key(path)
    if key is None:
        return None
    from miles.plan.model_table import load_table

    comps = {name: ComponentFacts(c["params"], c.get("blocks"), c.get("hidden"))
             for name, c in load_table()[key]["components"].items()}
    return ModelFacts(f"committed table ({key})", comps)


def _tokens(ns: Namespace, geo: Geometry, text_tokens: int) -> tuple[int, int]:
    """(image tokens per forward sample, text tokens in the blocks)."""
    t, h, w = geo.patch
    frames = (ns.diffusion_output_num_frames - 1) // geo.temporal + 1
    image = (math.ceil(frames / t) * (ns.diffusion_height // geo.spatial // h)
             * (ns.diffusion_width // geo.spatial // w))
    return image, text_tokens if geo.joint_text else 0


def _text_tokens(ns: Namespace) -> int:
    defaults = {"sd3": 77 + 256, "qwen_image": 512, "wan2_2": 512, "ltx": 128, "cosmos3": 512, "ltx2": 1024}
    return ns.diffusion_max_sequence_length or defaults[ns.diffusion_model_family]

# families whose pipeline (and engine) guides in one call on [negative; prompt] (FamilyModule.cfg_in_one_call)
CFG_IN_ONE_CALL = ("sd3", "ltx", "ltx2")


def _guided(ns: Namespace) -> bool:
    if ns.loss_type == "sft_loss":  # SFT forwards run unguided (miles/backends/sft.py)
        return False
    scales = [ns.diffusion_guidance_scale, ns.diffusion_guidance_scale_2 or 0.0]
    return get_family_facts(ns.diffusion_model_family).guided and max(scales) > 1.0

def _trained(ns: Namespace, facts: ModelFacts) -> list[str]:
    transformers = [n for n in facts.components if n.startswith("transformer")]
    return [n for n in (ns.update_weight_target_module or transformers) if n in facts.components]


def _lora_params(ns: Namespace, facts: ModelFacts, geo: Geometry, trained: list[str]) -> int:
    comps = facts.components
    return sum(int(ns.lora_rank * geo.lora_linears_per_block * comps[n].hidden) * comps[n].blocks for n in trained)
