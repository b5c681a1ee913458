"""The model families: torch-free facts (miles.diffusion_facts.families) joined with their diffusers code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from miles.models.families.base import FamilyModule
from miles.diffusion_facts.families import FAMILY_NAMES, UnknownFamilyError, get_family_facts, match_family
from miles.utils.dotted_path import load_callable


@dataclass(frozen=True)
class FamilySpec:
    name: str
    pipeline_class: str  # what a diffusers checkpoint's model_index.json names
    components: tuple[str, ...]  # components a checkpoint of this family must have
    transformer_components: tuple[str, ...]
    is_video: bool
    guided: bool
    default_sde_type: str
    default_shift: float
    lora_target_modules: tuple[str, ...]
    boundary_ratio: float | None
    module: FamilyModule


_MODULES = {
    "sd3": "miles.models.families.sd3:SD3",
    "qwen_image": "miles.models.families.qwen_image:QwenImage",
    "wan2_2": "miles.models.families.wan2_2:Wan22",
    "ltx": "miles.models.families.ltx:LTX",
    "cosmos3": "miles.models.families.cosmos3:Cosmos3",
    "ltx2": "miles.models.families.ltx2:LTX2",
}


def family_module(name: str) -> FamilyModule:
    return load_callable(_MODULES[name], "model family")()


def get_family(name: str) -> FamilySpec:
    facts = get_family_facts(name)
    module = family_module(facts.name)
    return FamilySpec(
        name=facts.name,
        pipeline_class=module.pipeline_class,
        components=(tuple(facts.transformer_components) + ("text_encoder", "tokenizer", "vae") + facts.extra_components
                    + ("scheduler",)),
        transformer_components=facts.transformer_components,
        is_video=facts.is_video,
        guided=facts.guided,
        default_sde_type=facts.default_sde_type,
        default_shift=facts.default_shift,
        lora_target_modules=facts.lora_target_modules,
        boundary_ratio=facts.boundary_ratio,
        module=module,
    )


def family_of_pipeline(pipeline_class: str) -> str | None:
    for name in _MODULES:
        module = family_module(name)
        if pipeline_class in (module.pipeline_class, *module.other_pipeline_classes):
            return name
    return None


def detect_family(path_or_name: str | Path) -> str:
    """The family a checkpoint's model_index.json declares, else the one its name matches."""
    index = Path(path_or_name) / "model_index.json"
    if index.is_file():
        declared = json.loads(index.read_text())
        if declared.get("_miles_family") in FAMILY_NAMES:
            return declared["_miles_family"]
        found = family_of_pipeline(declared.get("_class_name", ""))
        if found:
            return found
    matched = match_family(str(path_or_name))
    if matched is None:
        raise UnknownFamilyError(
            f"cannot tell the model family of {str(path_or_name)!r}; pass --diffusion-model-family "
            f"(one of {', '.join(FAMILY_NAMES)})"
        )
    return matched
