"""Build a family's checkpoint locally, in diffusers layout, deterministically from a seed.

    python3 -m miles.proxy_assets.checkpoint --family sd3 --size tiny --seed 0 --out DIR

Every component is initialised from its own seed (derived from the run seed and the component
name), saved with its own `save_pretrained`, into a temporary directory that is renamed into place
only when complete. The same arguments write the same bytes.

At size `tiny` the VAE is not left random: `miles.proxy_assets.vae_fit` trains it for a few
seconds into a small autoencoder of synthetic images (deterministically), so that decoded images,
and the colour/brightness rewards on them, respond to the latents.
"""

from __future__ import annotations

import argparse
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
from miles.proxy_assets import FITTED_VAES, checkpoint_name, fit_marker, is_current_checkpoint
from miles.proxy_assets.vae_fit import fit_vae
from miles.records.checkpoint_layout import class_path
from miles.utils.dotted_path import load_callable

SIZES = ("tiny", "proxy")


def vae_fit_marker(family: str, size: str) -> int | None:
    """What `_miles_vae_fit` in model_index.json says for a checkpoint built now (None: not fitted)."""
    vae = get_family(family).module.components(size).get("vae")
    return fit_marker(size, vae.class_name if vae is not None else None)


def build_component(spec: ComponentSpec, seed: int):
    if spec.class_name == "PreTrainedTokenizerFast":
        return build_tokenizer(**spec.config)
    torch.manual_seed(seed)
    cls = load_callable(class_path(spec.library, spec.class_name), "component class")
    if spec.config_class is not None:
        config_cls = load_callable(class_path(spec.library, spec.config_class), "component config class")
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
    if vae_fit_marker(family, size) is not None:
        index["_miles_vae_fit"] = vae_fit_marker(family, size)
    for name, component in components.items():
        # the seed of a component does not depend on which other components exist
        component_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        built = build_component(component, seed=component_seed)
        if size == "tiny" and name == "vae" and component.class_name in FITTED_VAES:
            fit_vae(built, seed=component_seed)
        built.save_pretrained(out / name)
        index[name] = [component.library, component.class_name]
    # from_config keeps keys the class does not take (Cosmos2's EDM sigma_min/sigma_max), as released configs do
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(spec.module.scheduler_config())
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
    """`<root>/miles-<family>-<size>-seed<seed>`, created on first use; safe across processes.

    A cached checkpoint built before its VAE was fitted (or by another fit version) is rebuilt."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / checkpoint_name(family, size, seed)
    with FileLock(str(path) + ".lock"):
        if not is_current_checkpoint(path, size):
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
