"""What the CPU and GPU proxies train on, made here from a seed instead of downloaded.

`checkpoint` builds a family's tiny or proxy checkpoint (its VAE fitted by `vae_fit`), `pickscore`
a tiny PickScore model, `prompts` the built-in prompt sets and a synthetic SFT dataset. The same
arguments give the same bytes. Production code only reads what these write.

This module names what the makers write; it imports no torch, so a dry run can name an asset
without making it.
"""

from __future__ import annotations


def checkpoint_name(family: str, size: str, seed: int) -> str:
    return f"miles-{family}-{size}-seed{seed}"


def tiny_pickscore_name(seed: int) -> str:
    return f"tiny-pickscore-seed{seed}"
