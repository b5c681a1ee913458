"""Setup of a sharded train rank without ever holding the whole weights: each trained transformer
is built on the meta device (`load_model(..., empty=...)`), sharded there, and then each rank
reads only its own rows of every weight from the checkpoint's safetensors files.

The old order loaded the whole pipeline in --param-dtype onto the GPU and sharded afterwards:
Qwen-Image's transformer alone is 82 GB in float32, more than the 80 GB GPU its recipe runs on.

LoRA. PEFT creates an adapter on the host, initialises it from the global RNG and then moves it
to the base layer's device, so on a meta base its values are lost. `lora_initial_values` attaches
the same adapter to a stand-in of the module whose weights are host scalars broadcast to their
shapes: PEFT runs its own initialisation there, in the same order and from the same RNG state as
it would on the loaded module (tests/unit/backends/test_sharded_load.py checks both bit for bit).

Frozen base. Under LoRA only the adapters are optimised, so the base weights need no float32
master: `frozen_base_to` gives them the compute dtype while they are still on meta (free). FSDP's
all-gather casts every shard to the compute dtype anyway, and the rows are read from the file
with the same round-to-nearest cast, so the gathered weights, and every forward, are bit for bit
those of a float32 base; the rank holds half the bytes (Qwen-Image full: 19.7 to 9.9 GiB).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from miles.backends.lora import ADAPTER_NAME, LoraSpec, attach_lora, is_lora_param
from miles.models.precision import PARAMETER, held_dtype, kept_modules

_PEFT_BASE = ".base_layer"


def _host_stand_in(module: torch.nn.Module) -> torch.nn.Module:
    """The module's structure with every parameter a host scalar expanded to its shape (no bytes)."""
    stand_in = copy.deepcopy(module)  # meta parameters: nothing is copied but the structure
    for sub in stand_in.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(
                    torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)
    return stand_in


def attach_lora_on_meta(module: torch.nn.Module, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """Attach the adapter to a meta-built module; returns the values PEFT gives it on a loaded
    one, by parameter name. The global RNG ends where attaching to the loaded module leaves it."""
    stand_in = _host_stand_in(module)
    before = torch.get_rng_state()
    attach_lora(stand_in, spec)
    after = torch.get_rng_state()
    values = {n: p.detach().clone() for n, p in stand_in.named_parameters() if is_lora_param(n)}
    torch.set_rng_state(before)
    attach_lora(module, spec)
    torch.set_rng_state(after)
    return values


@torch.no_grad()
def frozen_base_to(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Put every floating parameter that does not require grad in the dtype miles.models.precision
    holds it in at compute dtype `dtype` (before sharding: FSDP takes each parameter's dtype as it
    finds it; a module the class keeps in float32 stays so); returns how many were cast."""
    keep = kept_modules(module)
    cast = 0
    for sub_name, sub in module.named_modules():
        for name, p in sub._parameters.items():
            if p is None or p.requires_grad or not p.is_floating_point():
                continue
            want = held_dtype(keep, f"{sub_name}.{name}" if sub_name else name, PARAMETER, p.dtype, dtype)
            if p.dtype != want:
                sub._parameters[name] = torch.nn.Parameter(p.to(want), requires_grad=False)
                cast += 1
    return cast


def _checkpoint_name(param_name: str) -> str:
    """A PEFT-wrapped layer's base weight is stored under the layer's own name."""
    return param_name.replace(_PEFT_BASE + ".", ".")


def _local_rows(tensor: torch.Tensor):
    """(the tensor this rank holds, the index of its part in the whole tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def materialize_from_checkpoint(module: torch.nn.Module, folder: Path, device: torch.device,
                                lora_values: dict[str, torch.Tensor] | None = None) -> int:
    """Give a sharded meta-built module real storage on `device` and fill it: each parameter's
    rows of this rank from `folder`'s safetensors files, LoRA tensors from `lora_values`, buffers
    as they were computed at build time (or stored). Returns the bytes read from the files."""
    from safetensors import safe_open

    from miles.models.loader import CheckpointError, safetensors_index

    buffers = {(id(sub), name): (sub, name, b.to(device)) for sub in module.modules()
               for name, b in sub._buffers.items() if b is not None}
    module.to_empty(device=device)
    for sub, name, value in buffers.values():
        sub._buffers[name] = value
    index = safetensors_index(Path(folder))
    wanted: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if is_lora_param(name):
            local, rows = _local_rows(tensor)
            local.copy_(lora_values[name][rows])
            continue
        key = _checkpoint_name(name)
        if key in index:
            wanted.setdefault(index[key], []).append((key, tensor))
        elif isinstance(tensor, torch.nn.Parameter):
            raise CheckpointError(f"{folder}: no tensor {key!r} in its safetensors files, which its config.json builds")
    read = 0
    for file, tensors in wanted.items():
        with safe_open(str(file), framework="pt") as f:
            for key, tensor in tensors:
                local, rows = _local_rows(tensor)
                part = f.get_slice(key)[rows] if rows else f.get_tensor(key)
                local.copy_(part.to(local.dtype))
                read += part.numel() * part.element_size()
    return read


def rank_shard_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's tensors this rank holds."""
    return sum(_local_rows(t)[0].numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
