"""Computes miles/plan/model_sizes.json: `python3 -m miles.models.size_table`.

Each component of the released configs (`miles.plan.model_table.RELEASED`) and of our own tiny and
proxy checkpoints is built on torch's meta device from its config and counted. It imports torch
and the model classes, so it lives with the models; the memory plan only reads the JSON it writes
(`miles.plan.model_table.load_table`), keeping the dry path torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from miles.records.checkpoint_layout import class_path, is_diffusers_library
from miles.utils.dotted_path import load_callable
from miles.plan.model_table import OWN_SIZES, RELEASED, TABLE_PATH, _c, _checkpoint, own_key


def _own_specs() -> dict[str, dict[str, Any]]:
    from miles.models.registry import family_module
    from miles.diffusion_facts.families import FAMILY_NAMES

    out = {}
    for family in FAMILY_NAMES:
        for size in OWN_SIZES:
            comps = {}
            for name, spec in family_module(family).components(size).items():
                if spec.class_name == "PreTrainedTokenizerFast":
                    continue
                comps[name] = _c(spec.library, spec.class_name, dict(spec.config), spec.config_class)
            out[own_key(family, size)] = _checkpoint(family, comps)
    return out


def _count(component: dict[str, Any]) -> dict[str, Any]:
    import torch

    cls = load_callable(class_path(component['library'], component['class']), "component class")
    with torch.device("meta"):
        if is_diffusers_library(component["library"]):
            module = cls.from_config(component["config"])
        else:
            config = load_callable(f"transformers:{component['config_class']}", "component config class")
            module = cls(config(**component["config"]))
    entry: dict[str, Any] = {"class": component["class"], "params": int(sum(p.numel() for p in module.parameters()))}
    blocks = getattr(module, "transformer_blocks", None) or getattr(module, "blocks", None)
    if blocks is not None and "Transformer" in component["class"]:
        entry["blocks"] = len(blocks)
        entry["block_params"] = int(sum(p.numel() for p in blocks[0].parameters()))
        cfg = component["config"]
        entry["hidden"] = int(cfg.get("num_attention_heads", 0) * cfg.get("attention_head_dim", 0))
    return entry


def build_table() -> dict[str, Any]:
    from miles.models.runtime import quiet_libraries

    quiet_libraries()
    specs = {**RELEASED, **_own_specs()}
    return {key: {"family": spec["family"],
                  "components": {name: _count(comp) for name, comp in spec["components"].items()}}
            for key, spec in specs.items()}


def main() -> None:
    table = build_table()
    TABLE_PATH.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    for key, entry in table.items():
        total = sum(c["params"] for c in entry["components"].values())
        print(f"{key:40s} {total / 1e9:8.3f} B params")


if __name__ == "__main__":
    main()
