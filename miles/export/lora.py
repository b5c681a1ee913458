"""A LoRA checkpoint in the diffusers LoRA format, one file per trained transformer.

    <out>/pytorch_lora_weights.safetensors                  the `transformer` adapter
    <out>/pytorch_lora_weights_<component>.safetensors      any other one (Wan2.2's transformer_2)

Keys are what the pipelines' `load_lora_weights` reads: `transformer.<module path>.lora_A.weight`
(our checkpoint stores PEFT's injected names, `...lora_A.default.weight`; the adapter name goes,
the `transformer.` prefix comes). Every file says `transformer.` because the pipelines' loaders
select by that prefix and `load_into_transformer_2=True` is what routes a file to the second
expert. The safetensors metadata carries the adapter config (rank, alpha, target modules) under
diffusers' `lora_adapter_metadata` key, so an alpha other than the rank loads with the scale
training used instead of diffusers' default alpha = rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.backends.lora import ADAPTER_NAME, LoraSpec, is_lora_param
from miles.export.errors import ExportError

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer"


def weight_name(component: str) -> str:
    return LORA_WEIGHT_NAME if component == "transformer" else LORA_WEIGHT_NAME.replace(".safetensors",
                                                                                         f"_{component}.safetensors")


def diffusers_key(name: str) -> str:
    """`blocks.0.attn.to_q.lora_A.default.weight` -> `transformer.blocks.0.attn.to_q.lora_A.weight`."""
    for side in ("lora_A", "lora_B"):
        name = name.replace(f".{side}.{ADAPTER_NAME}.", f".{side}.")
    return f"{PREFIX}.{name}"


def adapter_metadata(spec: LoraSpec) -> str:
    config = {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": sorted(spec.target_modules)}
    return json.dumps({f"{PREFIX}.{k}": v for k, v in config.items()}, indent=2, sort_keys=True)


def write_lora(out: Path, spec: LoraSpec, component: str, reader, kind: str) -> Path:
    from safetensors.torch import save_file

    names = sorted(reader.infos(kind, component))
    stray = [n for n in names if not is_lora_param(n)]
    if stray:
        raise ExportError(f"the LoRA checkpoint's {component} holds a tensor that is not a LoRA weight ({stray[0]}); "
                          f"it is not a LoRA checkpoint this export understands")
    tensors = reader.read(kind, component, names)
    path = out / weight_name(component)
    save_file({diffusers_key(n): tensors[n].contiguous() for n in names}, str(path),
              metadata={"format": "pt", METADATA_KEY: adapter_metadata(spec)})
    sort_header_metadata(path)
    return path


def sort_header_metadata(path: Path) -> None:
    """Rewrite the file's header with its metadata keys sorted, in place.

    safetensors keeps metadata in a hash map whose order changes from process to process, so
    the same tensors and metadata would not give the same bytes; the tensors' entries and data
    are already in a fixed order. The rewritten JSON has the same length (same pairs, compact),
    padded with spaces as safetensors pads it, so no data offset moves."""
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        header = {"__metadata__": header.pop("__metadata__"), **header}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > length:
            raise ExportError(f"{path}: its safetensors header did not keep its length when sorted; report this")
        f.seek(8)
        f.write(text + b" " * (length - len(text)))
