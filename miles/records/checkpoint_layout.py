"""What a diffusers-layout checkpoint directory must hold, and the pixel grid its VAE and patch
sizes allow, read from its JSON files alone (no torch): the launcher's preflight and the cache of
built checkpoints (miles.proxy_assets) ask the same question.

A complete checkpoint has model_index.json; for each component it names, a folder; for a model
component a config.json and weights (*.safetensors or *.bin, whole or sharded with an index); for
a scheduler its scheduler_config.json; for a tokenizer or processor at least one file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

INDEX = "model_index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def class_path(library: str, class_name: str) -> str:
    """`module:Class` of a model_index.json entry, resolved as diffusers resolves it: a component of
    a pipeline's own (LTX-2's connectors: ["ltx2", "LTX2TextConnectors"]) names the pipeline's
    folder, diffusers.pipelines.<name>."""
    module = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
    return f"{module}:{class_name}"


def is_diffusers_library(library: str) -> bool:
    """Whether a component of this library is a diffusers class (built with from_config, torch_dtype)."""
    return library != "transformers"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def components(path: str | Path) -> dict[str, str]:
    """component -> class name, for the components model_index.json names (None entries skipped)."""
    index = _read_json(Path(path) / INDEX) or {}
    return {name: str(value[1]) for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[1]}


def _component_problem(folder: Path, class_name: str) -> str | None:
    if not folder.is_dir():
        return f"{folder.name}/ (a {class_name}) is missing"
    if "Scheduler" in class_name:
        return None if (folder / "scheduler_config.json").is_file() else f"{folder.name}/scheduler_config.json is missing"
    if "Tokenizer" in class_name or "Processor" in class_name:
        return None if any(folder.iterdir()) else f"{folder.name}/ is empty"
    if not (folder / "config.json").is_file():
        return f"{folder.name}/config.json is missing"
    if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in folder.iterdir()):
        return f"{folder.name}/ holds no weights (*.safetensors or *.bin)"
    return None


def component_config(path: str | Path, component: str) -> dict:
    """`<path>/<component>/config.json` ({} when missing or unreadable)."""
    return _read_json(Path(path) / component / "config.json") or {}


# (class, a config key that turns the need on) -> the library its forward imports lazily, which is
# no dependency of this project: diffusers' Cosmos transformer resizes its padding mask with
# torchvision, and without it the first forward stops at a NameError, minutes into a full run
OPTIONAL_LIBRARIES = {("CosmosTransformer3DModel", "concat_padding_mask"): "torchvision"}


def libraries_needed(path: str | Path) -> dict[str, str]:
    """library -> "component (class with key)" for the optional libraries the checkpoint's models need."""
    needed = {}
    for name, cls in components(path).items():
        config = component_config(path, name)
        for (needs_class, key), library in OPTIONAL_LIBRARIES.items():
            if cls == needs_class and config.get(key):
                needed.setdefault(library, f"{name}/ ({cls} with {key})")
    return needed


def missing_parts(path: str | Path, required: tuple[str, ...] = ()) -> list[str]:
    """What keeps `path` from being a complete checkpoint (empty: complete). `required`: components
    the model family needs whether or not model_index.json names them."""
    root = Path(path)
    if not root.is_dir():
        return [f"{root} is not a directory"]
    if _read_json(root / INDEX) is None:
        return [f"{INDEX} is missing or unreadable"]
    named = components(root)
    problems = [f"{name}/ is not named in {INDEX}" for name in required if name not in named]
    problems += [p for name, cls in sorted(named.items()) if (p := _component_problem(root / name, cls))]
    return problems


@dataclass(frozen=True)
class PixelGrid:
    """Height and width must be multiples of `spatial`; a video's frames must be 1 + a multiple of
    `temporal` (its latent frames a multiple of `patch_t`)."""

    spatial: int
    temporal: int | None = None
    patch_t: int = 1

    def nearest(self, value: int) -> tuple[int, int]:
        below = max(self.spatial, value // self.spatial * self.spatial)
        return below, below + self.spatial

    def frames_ok(self, frames: int) -> bool:
        if self.temporal is None:
            return True
        return (frames - 1) % self.temporal == 0 and ((frames - 1) // self.temporal + 1) % self.patch_t == 0

    def nearest_frames(self, frames: int) -> tuple[int, int]:
        valid = [f for f in range(1, frames + 4 * self.temporal * self.patch_t + 2) if self.frames_ok(f)]
        below = [f for f in valid if f <= frames] or valid[:1]
        return below[-1], next(f for f in valid if f > frames)


def pixel_grid(path: str | Path) -> PixelGrid | None:
    """From vae/config.json and transformer/config.json; None when they do not say (no check)."""
    root = Path(path)
    vae = _read_json(root / "vae" / "config.json")
    transformer = _read_json(root / "transformer" / "config.json") or {}
    if vae is None:
        return None
    spatial, temporal = _vae_compression(vae)
    if spatial is None:
        return None
    patch = transformer.get("patch_size", 1) or 1
    patch_h = patch[-1] if isinstance(patch, list) else patch
    patch_t = patch[0] if isinstance(patch, list) and len(patch) == 3 else transformer.get("patch_size_t") or 1
    return PixelGrid(spatial * int(patch_h), temporal, int(patch_t))


def _vae_compression(vae: dict) -> tuple[int | None, int | None]:
    """(spatial, temporal) compression of the VAE classes the families use."""
    if "temperal_downsample" in vae:  # AutoencoderKLWan / AutoencoderKLQwenImage
        steps = vae["temperal_downsample"]
        return 2 ** len(steps), 2 ** sum(bool(s) for s in steps)
    if "spatio_temporal_scaling" in vae:  # AutoencoderKLLTXVideo
        scaling = sum(bool(s) for s in vae["spatio_temporal_scaling"])
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 1) * 2 ** scaling
        temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2 ** scaling
        return int(spatial), int(temporal)
    if "block_out_channels" in vae:  # AutoencoderKL
        return 2 ** (len(vae["block_out_channels"]) - 1), None
    return None, None
