"""Which checkpoint to export, and what the run that wrote it said about it.

A checkpoint alone does not say what it was trained from: the base checkpoint, the LoRA rank and
the family are flags of the run. They are read from the run directory's `run.json` (the trainer's
argv), found beside the checkpoints (`<run dir>/checkpoints/rollout_NNNNNN`, the recipes' layout).
Every refusal is an ExportError: one line naming what is missing and what to do.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from miles.backends import checkpoint as ckpt
from miles.backends.fsdp import MANIFEST, read_manifest
from miles.backends.lora import LoraSpec, lora_spec_from_args
from miles.export.errors import ExportError
from miles.models.registry import detect_family
from miles.diffusion_facts.families import get_family_facts

RUN_RECORD = "run.json"
STAGING_PREFIX = ".staging_"
ROLLOUT_DIR = re.compile(r"^rollout_(\d+)$")


@dataclass(frozen=True)
class CheckpointSource:
    checkpoint: Path  # the committed rollout_NNNNNN directory
    rollout_id: int
    run_dir: Path
    train_argv: list[str]
    train_args: argparse.Namespace
    family: str
    base: Path  # the run's --hf-checkpoint
    backend: str  # "dp" or "fsdp" (rank0.json)
    lora: LoraSpec | None


def locate(path: str | Path, rollout: str = "latest", family: str | None = None) -> CheckpointSource:
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path} does not exist; pass a run dir, its checkpoints dir or one rollout_NNNNNN dir")
    if path.name.startswith(STAGING_PREFIX):
        raise ExportError(f"{path} is a checkpoint still being written (mid-commit); export a committed "
                          f"rollout_NNNNNN dir once the save has finished")
    run_dir, root, chosen = _roles(path)
    argv = _train_argv(run_dir, path)
    args = _parse_train_argv(argv)
    if chosen is None:
        chosen = _committed(root or _checkpoints_of(run_dir, args), rollout)
    elif rollout != "latest" and _rollout_id(chosen) != int(rollout):
        raise ExportError(f"--rollout {rollout} asks for another checkpoint than {chosen}; pass the run dir instead")
    base = Path(args.hf_checkpoint)
    if not (base / "model_index.json").is_file():
        raise ExportError(f"the base checkpoint {base} (the run's --hf-checkpoint) is missing or has no "
                          f"model_index.json; the export copies its configs: restore it there")
    found = args.diffusion_model_family or detect_family(base)
    if family is not None and family != found:
        raise ExportError(f"--family {family}: {chosen} is a {found} checkpoint (base {base}); "
                          f"pass --family {found} or the checkpoint of a {family} run")
    manifest = _check_complete(chosen)
    lora = lora_spec_from_args(args, get_family_facts(found)) if manifest.get("lora") else None
    return CheckpointSource(chosen, _rollout_id(chosen), run_dir, argv, args, found, base,
                            manifest.get("backend", "dp"), lora)


def _roles(path: Path) -> tuple[Path | None, Path | None, Path | None]:
    """(run dir, checkpoint root, chosen checkpoint) as far as `path` tells them."""
    if (path / RUN_RECORD).is_file():
        return path, None, None
    if ROLLOUT_DIR.match(path.name) or (path / "trainer.json").is_file():
        return _run_dir_above(path.parent), path.parent, path
    if (path / ckpt.LATEST).exists() or any(path.glob("rollout_*")) or any(path.glob(STAGING_PREFIX + "*")):
        return _run_dir_above(path), path, None
    raise ExportError(f"{path} is neither a run dir ({RUN_RECORD}), a checkpoints dir ({ckpt.LATEST}) nor a "
                      f"checkpoint (trainer.json); pass one of those")


def _checkpoints_of(run_dir: Path, args: argparse.Namespace) -> Path:
    """The checkpoints under the run dir given. run.json's --save is where they were written, which
    is somewhere else once the run dir was moved or copied: what was given is what is exported."""
    here = run_dir / "checkpoints"
    recorded = Path(args.save) if args.save else None
    if recorded is None or recorded.resolve() == here.resolve():
        return here
    if here.is_dir():
        print(f"note: {run_dir / RUN_RECORD} records --save {recorded}; exporting the checkpoints under the "
              f"directory given, {here}", file=sys.stderr, flush=True)
        return here
    raise ExportError(f"{run_dir} has no checkpoints/ directory and its {RUN_RECORD} records --save {recorded}, "
                      f"outside it; the export reads only the directory it is given: move that checkpoints "
                      f"directory to {here} and export again")


def _run_dir_above(root: Path) -> Path | None:
    return root.parent if (root.parent / RUN_RECORD).is_file() else None


def _train_argv(run_dir: Path | None, asked: Path) -> list[str]:
    if run_dir is None:
        raise ExportError(f"no {RUN_RECORD} of the run that wrote {asked} (looked in the dir above its checkpoints); "
                          f"the export reads the run's flags from it: keep the checkpoints inside their run dir")
    return list(json.loads((run_dir / RUN_RECORD).read_text())["argv"])


def _parse_train_argv(argv: list[str]) -> argparse.Namespace:
    from miles.flags.arguments import build_parser

    args, _unknown = build_parser().parse_known_args(argv)  # a flag since retired does not block an export
    return args


def _committed(root: Path, rollout: str) -> Path:
    if rollout == "latest":
        pointer = root / ckpt.LATEST
        if not pointer.exists():
            staging = sorted(p.name for p in root.glob(STAGING_PREFIX + "*")) if root.exists() else []
            what = f"a save is under way ({staging[-1]}, mid-commit)" if staging else "no save has finished"
            raise ExportError(f"{root} has no committed checkpoint ({ckpt.LATEST} is missing: {what}); "
                              f"export once a save has committed")
        return root / pointer.read_text().strip()
    chosen = root / ckpt.checkpoint_name(int(rollout))
    if chosen.exists():
        return chosen
    if (root / (STAGING_PREFIX + chosen.name)).exists():
        raise ExportError(f"rollout {rollout} is mid-commit ({root / (STAGING_PREFIX + chosen.name)} exists, "
                          f"{chosen.name} does not); export it once the save has finished")
    have = sorted(p.name for p in root.glob("rollout_*"))
    raise ExportError(f"--rollout {rollout}: {chosen} does not exist; committed: {', '.join(have) or 'none'}")


def _rollout_id(checkpoint: Path) -> int:
    meta = checkpoint / "trainer.json"
    if meta.is_file():
        return int(json.loads(meta.read_text())["rollout_id"])
    matched = ROLLOUT_DIR.match(checkpoint.name)
    if matched is None:
        raise ExportError(f"{checkpoint} is incomplete: trainer.json is missing")
    return int(matched.group(1))


def _check_complete(checkpoint: Path) -> dict:
    """The checkpoint's manifest, once every file its backend writes is there."""
    missing = [name for name in ("trainer.json", MANIFEST) if not (checkpoint / name).is_file()]
    if missing:
        raise ExportError(f"{checkpoint} is incomplete: {', '.join(missing)} missing; export another rollout "
                          f"(--rollout N) or the run's latest committed checkpoint")
    manifest = read_manifest(checkpoint)
    if manifest.get("backend", "dp") == "fsdp":
        shards = [f"__{r}_0.distcp" for r in range(int(manifest["world_size"]))] + [".metadata"]
        missing = [name for name in shards if not (checkpoint / name).is_file()]
    else:
        missing = [] if any(checkpoint.glob("model_*.safetensors")) else ["model_<component>.safetensors"]
    if missing:
        raise ExportError(f"{checkpoint} is incomplete: {', '.join(missing)} missing; export another rollout "
                          f"(--rollout N) or the run's latest committed checkpoint")
    return manifest
