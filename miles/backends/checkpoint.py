"""Checkpoint layout and crash-safe commit.

    <save>/rollout_000004/            one committed checkpoint (rollout 4 finished)
        trainer.json                  rollout id and the run's identity (miles.records.checkpoint_identity)
        driver.pt                     driver state (data position, ...)
        model_<component>.safetensors trained weights (full, or LoRA pairs only)
        ema_<component>.safetensors   EMA shadow, when --use-ema
        optimizer.pt                  AdamW state (identical on every rank after all-reduce)
        rng_rank<r>.pt                each rank's RNG states
    <save>/latest                     name of the newest committed checkpoint

A checkpoint is written into a staging directory, fsynced (files, directories) and renamed into
place; `latest` is written, fsynced and replaced by rename too, so a kill or power cut at any
moment leaves the previous checkpoint whole and named. `--keep-last N` (with `--keep-every K`)
deletes older checkpoints only after the new one is committed.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from miles.records import checkpoint_identity as identity

LATEST = identity.LATEST


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


def _fsync_tree(path: Path) -> None:
    """Every file's data, then every directory's entries, so a power cut cannot leave a named but empty file."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        _fsync_dir(d)
    _fsync_dir(path)


def commit(staging: Path, root: str | Path, rollout_id: int, *, keep_last: int | None = None,
           keep_every: int | None = None) -> Path:
    """Make a fully written staging directory the newest checkpoint, then drop what retention
    does not keep. A re-save of an existing id sets the old directory aside and deletes it only
    once the new one is in place and `latest` names it (identity.latest reads the set-aside one
    if a kill strikes in between)."""
    root = Path(root)
    _fsync_tree(staging)
    final = root / checkpoint_name(rollout_id)
    replaced = root / f"{identity.REPLACED_PREFIX}{final.name}"
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)  # an older set-aside copy; `final` is whole
        os.rename(final, replaced)
    os.rename(staging, final)
    _point_latest(root, final.name)
    shutil.rmtree(replaced, ignore_errors=True)
    prune(root, keep_last, keep_every)
    return final


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, root / LATEST)
    _fsync_dir(root)


def prune(root: str | Path, keep_last: int | None, keep_every: int | None = None) -> list[Path]:
    """Delete committed checkpoints outside `--keep-last N` (and every `--keep-every K`th);
    never the one `latest` names. Returns what was deleted."""
    committed = identity.all_committed(root)
    keep = identity.retained([c.rollout_id for c in committed], keep_last, keep_every)
    newest = identity.latest(root)
    doomed = [c.path for c in committed if c.rollout_id not in keep and (newest is None or c.path != newest.path)]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        _fsync_dir(Path(root))
    return doomed


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """(rollout id, path) of the newest committed checkpoint under root, or None."""
    found = identity.latest(root)
    return None if found is None else (found.rollout_id, found.path)


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
