"""Build a family's checkpoint locally, in diffusers layout, deterministically from a seed.

    python3 -m miles.models.create_checkpoint --family sd3 --size tiny --seed 0 --out DIR

Every component is initialised from its own seed (derived from the run seed and the component
name), saved with its own `save_pretrained`, into a temporary directory that is renamed into place
only when complete. The same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import zlib
from pathlib import Path

import torch
from filelock import FileLock

from miles.models.families.base import ComponentSpec
from miles.models.registry import get_family
from miles.models.runtime import quiet_libraries
from miles.models.tokenizer import build_tokenizer

SIZES = ("tiny", "proxy")


def checkpoint_name(family: str, size: str, seed: int) -> str:
    return f"miles-{family}-{size}-seed{seed}"


def build_component(spec: ComponentSpec, seed: int):
    if spec.class_name == "PreTrainedTokenizerFast":
        return build_tokenizer(**spec.config)
    torch.manual_seed(seed)
    cls = getattr(importlib.import_module(spec.library), spec.class_name)
    if spec.config_class is not None:
        config_cls = getattr(importlib.import_module(spec.library), spec.config_class)
        return cls(config_cls(**spec.config)).eval()
    return cls(**spec.config).eval()


def _write_checkpoint(family: str, size: str, seed: int, out: Path) -> None:
    quiet_libraries()
    from diffusers import FlowMatchEulerDiscreteScheduler, __version__ as diffusers_version

    spec = get_family(family)
    components = spec.module.components(size)
    index: dict = {"_class_name": spec.pipeline_class, "_diffusers_version": diffusers_version, "_miles_family": family}
    if spec.boundary_ratio is not None:
        index["boundary_ratio"] = spec.boundary_ratio
    for name, component in components.items():
        # the seed of a component does not depend on which other components exist
        built = build_component(component, seed=(seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        built.save_pretrained(out / name)
        index[name] = [component.library, component.class_name]
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.default_shift)
    scheduler.save_pretrained(out / "scheduler")
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def create_checkpoint(family: str, size: str, seed: int, out: str | os.PathLike, overwrite: bool = False) -> Path:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_checkpoint(family, size, seed, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_checkpoint(family: str, size: str, seed: int, root: str | os.PathLike) -> Path:
    """`<root>/miles-<family>-<size>-seed<seed>`, created on first use; safe across processes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / checkpoint_name(family, size, seed)
    with FileLock(str(path) + ".lock"):
        if not (path / "model_index.json").is_file():
            create_checkpoint(family, size, seed, path, overwrite=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True)
    parser.add_argument("--size", default="tiny", choices=SIZES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    print(create_checkpoint(args.family, args.size, args.seed, args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
