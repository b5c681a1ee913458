"""What the CPU and GPU proxies train on, made here from a seed instead of downloaded.

`checkpoint` builds a family's tiny or proxy checkpoint (its VAE fitted by `vae_fit`), `pickscore`
a tiny PickScore model, `prompts` the built-in prompt sets and a synthetic SFT dataset. The same
arguments give the same bytes. Production code only reads what these write.

This module names what the makers write; it imports no torch, so a dry run can name an asset
without making it.
"""

from __future__ import annotations

import json
from pathlib import Path

FIT_VERSION = 1  # recorded in model_index.json; bump when the fit changes, so cached checkpoints rebuild
# what create_checkpoint fits at size tiny (vae_fit): each under ~10 s on one core. The Wan and
# Qwen-Image VAEs (causal 3D convolutions) take about 18-20 s and fit worse in that budget, so
# they stay random.
FITTED_VAES = ("AutoencoderKL", "AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")


def checkpoint_name(family: str, size: str, seed: int) -> str:
    return f"miles-{family}-{size}-seed{seed}"


def tiny_pickscore_name(seed: int) -> str:
    return f"tiny-pickscore-seed{seed}"


def fit_marker(size: str, vae_class: str | None) -> int | None:
    """What `_miles_vae_fit` in model_index.json says for a checkpoint of this size and VAE class
    built now (None: its VAE is not fitted)."""
    return FIT_VERSION if size == "tiny" and vae_class in FITTED_VAES else None


def is_current_checkpoint(path: str | Path, size: str) -> bool:
    """A complete checkpoint (model_index.json is written last, in a folder renamed into place, and
    every component it names still holds its config and weights) that a build now would not replace. Read without torch: a recipe whose checkpoint is cached skips
    importing the makers (1.7 s a run)."""
    try:
        index = json.loads((Path(path) / "model_index.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    vae = index.get("vae")
    if not (isinstance(vae, list) and len(vae) == 2):
        return False
    if index.get("_miles_vae_fit") != fit_marker(size, vae[1]):
        return False
    from miles.records.checkpoint_layout import missing_parts

    return not missing_parts(path)  # a component lost since (a partial copy, a deleted folder): rebuild


def is_built_pickscore(path: str | Path) -> bool:
    """A complete tiny PickScore (built in a temporary folder and renamed into place)."""
    return (Path(path) / "config.json").is_file()
