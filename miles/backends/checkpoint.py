"""Checkpoint layout and crash-safe commit.

    <save>/rollout_000004/            one committed checkpoint (rollout 4 finished)
        trainer.json                  rollout id, optimizer step, world size
        driver.pt                     driver state (data position, ...)
        model_<component>.safetensors trained weights (full, or LoRA pairs only)
        ema_<component>.safetensors   EMA shadow, when --use-ema
        optimizer.pt                  AdamW state (identical on every rank after all-reduce)
        rng_rank<r>.pt                each rank's RNG states
    <save>/latest                     name of the newest committed checkpoint

A checkpoint is written into a staging directory and renamed into place, and `latest` is
replaced by rename too, so a kill at any moment leaves the previous checkpoint whole and named.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LATEST = "latest"


def checkpoint_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:06d}"


def staging_dir(root: str | Path, rollout_id: int) -> Path:
    path = Path(root) / f".staging_{checkpoint_name(rollout_id)}"
    if path.exists():
        shutil.rmtree(path)  # a save killed half-way
    path.mkdir(parents=True)
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, root: str | Path, rollout_id: int) -> Path:
    """Make a fully written staging directory the newest checkpoint."""
    root = Path(root)
    for f in staging.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = root / checkpoint_name(rollout_id)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(final.name + "\n")
    os.rename(tmp, root / LATEST)
    _fsync_dir(root)
    return final


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """(rollout id, path) of the newest committed checkpoint under root, or None."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    meta = json.loads((path / "trainer.json").read_text())
    return int(meta["rollout_id"]), path


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
