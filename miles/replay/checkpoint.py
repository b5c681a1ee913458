"""A checkpoint folder of configs only, for the replay to load on the meta device.

The replay loads a recipe's model through the project's own loader (`load_model(...,
device="meta")`), which reads `model_index.json`, each component's config and the scheduler's
config, and no weights. Those configs come from the committed size table: the released
configs (`miles.plan.model_table.RELEASED`) or our own sizes (each family's `components(size)`).
`blocks` rebuilds every transformer with that many blocks instead of its own count: the replay
measures at two small depths and extrapolates (miles.replay.run says why that is exact).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.plan.model_table import OWN_SIZES, RELEASED, own_key

BLOCK_KEYS = ("num_layers",)  # the config key that counts a diffusers transformer's blocks
SCHEDULER = ["diffusers", "FlowMatchEulerDiscreteScheduler"]


class ReplayCheckpointError(ValueError):
    """A checkpoint the committed table cannot describe (the replay has nothing to build)."""


def component_specs(key: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """(family, {component: {library, class, config, config_class?}}) of a table key."""
    if key in RELEASED:
        entry = RELEASED[key]
        return entry["family"], entry["components"]
    for size in OWN_SIZES:
        for family in _families():
            if key == own_key(family, size):
                from miles.models.registry import family_module

                specs = {}
                for name, spec in family_module(family).components(size).items():
                    specs[name] = {"library": spec.library, "class": spec.class_name, "config": dict(spec.config),
                                   "config_class": spec.config_class}
                return family, specs
    raise ReplayCheckpointError(f"{key}: not in the committed size table (miles/plan/model_table.py)")


def _families() -> tuple[str, ...]:
    from miles.diffusion_facts.families import FAMILY_NAMES

    return tuple(FAMILY_NAMES)


def block_count(config: dict[str, Any]) -> int | None:
    return next((config[k] for k in BLOCK_KEYS if k in config), None)


def dual_blocks(config: dict[str, Any]) -> int:
    """SD3.5: how many blocks carry a second attention (the first ones; 0 for other models)."""
    return len(config.get("dual_attention_layers") or ())


def _with_blocks(config: dict[str, Any], blocks: int, dual: int | None = None) -> dict[str, Any]:
    out = {**config, "num_layers": blocks}
    if "dual_attention_layers" in out:  # SD3.5: which of the blocks carry a second attention
        out["dual_attention_layers"] = list(range(min(blocks, dual if dual is not None else dual_blocks(out))))
    return out


def write_config_checkpoint(key: str, root: Path, blocks: int | None = None, dual: int | None = None) -> Path:
    """`root/<key>`: model_index.json, every component's config.json, the scheduler config."""
    from miles.models.registry import family_module

    family, specs = component_specs(key)
    if family is None:
        raise ReplayCheckpointError(f"{key}: not a diffusion pipeline")
    module = family_module(family)
    path = root / key
    index: dict[str, Any] = {"_class_name": module.pipeline_class, "scheduler": SCHEDULER}
    for name, spec in specs.items():
        index[name] = [spec["library"], spec["class"]]
        folder = path / name
        folder.mkdir(parents=True, exist_ok=True)
        config = dict(spec["config"])
        if blocks is not None and name.startswith("transformer") and block_count(config) is not None:
            config = _with_blocks(config, blocks, dual)
        if spec["library"] == "transformers" and spec.get("config_class"):
            _write_transformers_config(spec["config_class"], config, folder)
        else:
            (folder / "config.json").write_text(json.dumps({"_class_name": spec["class"], **config}))
    for name in [f"tokenizer{n[len('text_encoder'):]}" for n in specs if n.startswith("text_encoder")]:
        index[name] = ["transformers", "PreTrainedTokenizerFast"]  # no tensors: the meta load leaves it None
        (path / name).mkdir(parents=True, exist_ok=True)
    (path / "scheduler").mkdir(parents=True, exist_ok=True)
    (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(module.scheduler_config()))
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def _write_transformers_config(config_class: str, config: dict[str, Any], folder: Path) -> None:
    from miles.utils.dotted_path import load_callable

    cls = load_callable(f"transformers:{config_class}", "config class")
    cls(**config).save_pretrained(str(folder))
