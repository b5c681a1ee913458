"""Which run a checkpoint belongs to, and whether this run may load it or write beside it.

Torch-free: the launcher's preflight (before Ray) and the trainer's driver (before any actor) run
the same checks on the same `trainer.json` records, so a direct `train_diffusion.py` run is held
to what a recipe launch is.

Every committed checkpoint's `trainer.json` records:
    rollout_id          the rollout it finished
    run_id              the run that wrote it (the run dir's name)
    training_flags      the flags of TRAINING_FLAGS with their values, and their hash
    data_order          seed, shuffle, epoch and position in the epoch of the prompt data
    code_version        the git commit (or package version) that wrote it
    wandb_run_id        the wandb run mirrored to, when wandb was on (a resume continues it)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LATEST = "latest"
RECORD = "trainer.json"
CHECKPOINT_PREFIX = "rollout_"
REPLACED_PREFIX = ".replaced_"  # a committed dir set aside while a re-save of its id is renamed in

# Flags whose value changes what training computes. Paths (checkpoint, prompt files), run length,
# save cadence, logging, layout of ranks and debug switches are left out: a resume may change them.
TRAINING_FLAGS = (
    "diffusion_model_family", "loss_type", "custom_loss_function_path", "advantage_estimator",
    "rm_type", "custom_rm_path", "reward_key",
    "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_steps_per_rollout",
    "diffusion_num_steps", "diffusion_num_sde_steps", "diffusion_step_strategy_path",
    "diffusion_sde_window_max_start", "diffusion_noise_level", "diffusion_guidance_scale",
    "diffusion_guidance_scale_2", "diffusion_height", "diffusion_width", "diffusion_output_num_frames",
    "diffusion_sde_type", "diffusion_shift", "diffusion_max_sequence_length", "negative_prompt",
    "diffusion_clip_range", "diffusion_adv_clip_max", "diffusion_kl_beta", "diffusion_kl_reference",
    "globalize_reward_mean", "globalize_reward_std", "nft_beta", "use_ema", "ema_decay",
    "lr", "min_lr", "lr_decay_style", "lr_warmup_steps", "adam_beta1", "adam_beta2", "adam_eps",
    "weight_decay", "clip_grad", "seed",
    "use_lora", "lora_rank", "lora_alpha", "lora_target_modules", "update_weight_target_module",
    "param_dtype", "compute_dtype", "rollout_dtype",
)


class CheckpointRefused(ValueError):
    """This run may not load, or write beside, these checkpoints; the message names why and the fix."""


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def training_flags(args: Namespace) -> dict[str, Any]:
    return {dest: _plain(getattr(args, dest, None)) for dest in TRAINING_FLAGS}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def flags_hash(flags: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(flags, sort_keys=True).encode()).hexdigest()[:16]


_CODE_VERSION: list[str] = []


def code_version() -> str:
    """The git commit of the code running, else the installed package's version."""
    if not _CODE_VERSION:
        repo = Path(__file__).resolve().parents[2]
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
            found = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found = ""
        if not found:
            from importlib.metadata import PackageNotFoundError, version

            try:
                found = f"miles-diffusion {version('miles-diffusion')}"
            except PackageNotFoundError:
                found = "unknown"
        _CODE_VERSION.append(found)
    return _CODE_VERSION[0]


def run_id_of(args: Namespace) -> str:
    return Path(args.run_dir).name


def checkpoint_record(args: Namespace, rollout_id: int, data_order: dict | None,
                      wandb_run_id: str | None = None) -> dict:
    flags = training_flags(args)
    record = {"rollout_id": rollout_id, "run_id": run_id_of(args), "training_flags": flags,
              "training_flags_hash": flags_hash(flags), "data_order": data_order, "code_version": code_version(),
              "wandb_run_id": wandb_run_id}
    if getattr(args, "load_anyway", False):
        record["loaded_anyway_from"] = args.load
    return record


# ---- reading what a save dir holds ----

@dataclass(frozen=True)
class Committed:
    rollout_id: int
    path: Path
    record: dict


def read_committed(path: Path) -> Committed | None:
    try:
        record = json.loads((path / RECORD).read_text())
        return Committed(int(record["rollout_id"]), path, record)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest(root: str | Path | None) -> Committed | None:
    """The checkpoint `<root>/latest` names; if a re-save was killed between setting the old
    directory aside and renaming the new one in, the set-aside one (still whole) is read."""
    if not root:
        return None
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    if not name:
        return None
    return read_committed(root / name) or read_committed(root / f"{REPLACED_PREFIX}{name}")


def all_committed(root: str | Path | None) -> list[Committed]:
    """Every committed checkpoint directory under root, oldest rollout first."""
    if not root or not Path(root).is_dir():
        return []
    found = [read_committed(p) for p in Path(root).iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and p.is_dir()]
    return sorted((c for c in found if c is not None), key=lambda c: c.rollout_id)


def retained(ids: list[int], keep_last: int | None, keep_every: int | None) -> set[int]:
    """Rollout ids a save dir keeps: the newest keep_last, and every id whose rollout count is a
    multiple of keep_every (None: keep all)."""
    if keep_last is None:
        return set(ids)
    newest = sorted(ids)[-keep_last:]
    every = {i for i in ids if keep_every and (i + 1) % keep_every == 0}
    return set(newest) | every


# ---- the checks ----

def check_save_dir(save: str | None, run_id: str, load: str | None) -> None:
    """--save may hold only this run's checkpoints, and only when this run resumes."""
    if not save:
        return
    committed = all_committed(save)
    foreign = [c for c in committed if c.record.get("run_id") != run_id]
    if foreign:
        other = foreign[-1]
        owner = other.record.get("run_id") or "a run that recorded no run id"
        raise CheckpointRefused(
            f"--save {save} holds checkpoints of another run ({owner}: {len(foreign)} checkpoint(s), newest "
            f"{other.path.name}); a run writes only beside its own checkpoints, whatever --load says; fix: point "
            f"--save (or --run-id) somewhere new, or resume that run with its own --run-id {owner}")
    if committed and not load:
        found = latest(save) or committed[-1]
        raise CheckpointRefused(
            f"--save {save} already holds committed checkpoints (latest {found.path.name}, rollout "
            f"{found.rollout_id}) and this run was not asked to resume them; fix: add --load {save} to resume "
            f"that run, or point --save (or --run-id) somewhere new")


def find_load(load: str) -> Committed:
    """The checkpoint `--load DIR` resumes: DIR/latest's. CheckpointRefused naming what was looked for."""
    root = Path(load)
    if not root.is_dir():
        raise CheckpointRefused(f"--load {load}: no such directory (looked for {root / LATEST} naming a committed "
                                f"checkpoint); fix: give the --save directory of the run to resume, or drop --load")
    found = latest(root)
    if found is None:
        pointer = root / LATEST
        why = "is missing" if not pointer.exists() else f"names {pointer.read_text().strip()!r}, which has no {RECORD}"
        raise CheckpointRefused(f"--load {load} holds no committed checkpoint ({pointer} {why}); fix: give the --save "
                                f"directory of the run to resume, or drop --load to start fresh")
    return found


def flag_differences(args: Namespace, record: dict) -> list[str]:
    """'--flag now (checkpoint: then)' for each training flag whose value differs."""
    saved = record.get("training_flags")
    if not isinstance(saved, dict):
        return ["(the checkpoint records no training flags: written before run identities)"]
    ours = training_flags(args)
    return [f"{flag_name(k)} {_show(ours[k])} (checkpoint: {_show(saved.get(k))})"
            for k in TRAINING_FLAGS if k in saved and saved.get(k) != ours[k]]


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "unset" if value is None else str(value)


def data_order_conflicts(args: Namespace, record: dict) -> list[str]:
    order = record.get("data_order") or {}
    conflicts = []
    if "seed" in order and order["seed"] != getattr(args, "rollout_seed", order["seed"]):
        conflicts.append(f"--rollout-seed {args.rollout_seed} (checkpoint: {order['seed']})")
    if "shuffle" in order and bool(order["shuffle"]) != bool(getattr(args, "rollout_shuffle", order["shuffle"])):
        conflicts.append(f"--{'' if args.rollout_shuffle else 'no-'}rollout-shuffle (checkpoint: "
                         f"{_show(bool(order['shuffle']))})")
    return conflicts


@dataclass(frozen=True)
class LoadCheck:
    checkpoint: Committed | None
    differences: list[str]  # accepted with --load-anyway; empty otherwise


def check_load(args: Namespace) -> LoadCheck:
    """--load names a committed checkpoint trained with this run's training flags and data order."""
    if not getattr(args, "load", None):
        return LoadCheck(None, [])
    found = find_load(args.load)
    where = f"--load {args.load} ({found.path.name} of run {found.record.get('run_id') or 'unknown'})"
    conflicts = data_order_conflicts(args, found.record)
    if conflicts:
        raise CheckpointRefused(f"{where} fixes the data order, and this run asks for another: "
                                f"{'; '.join(conflicts)}; fix: pass the checkpoint's values or drop them")
    differences = flag_differences(args, found.record)
    if differences and not getattr(args, "load_anyway", False):
        raise CheckpointRefused(f"{where} was trained with other training flags: {'; '.join(differences)}; fix: "
                                f"resume with the checkpoint's values, or add --load-anyway to load it regardless")
    return LoadCheck(found, differences)


def check_run_checkpoints(args: Namespace) -> LoadCheck:
    """Both checks, --save first (another run's checkpoints are refused whatever --load says)."""
    check_save_dir(getattr(args, "save", None), run_id_of(args), getattr(args, "load", None))
    return check_load(args)


def data_order_line(found: Committed) -> str:
    order = found.record.get("data_order") or {}
    if not order:
        return f"data order: restored from {found.path} (it records no seed)"
    total = next((v for k, v in order.items() if k.startswith("num_")), "?")
    return (f"data order: restored from {found.path.name}: seed {order.get('seed')}, shuffle "
            f"{_show(bool(order.get('shuffle')))}, epoch {order.get('epoch')}, next item {order.get('offset')} of "
            f"{total}")
