"""One dtype rule for every tensor of a transformer: what the engine holds it in, what the trainer
computes it in, what a weight push sends it in.

The rule is the model class's own: `from_pretrained(torch_dtype=<lower dtype>)` keeps the
parameters and buffers of the modules its class lists in `_keep_in_fp32_modules` in float32 (a
module name matches any dotted part of a tensor's qualified name, as diffusers matches it: Wan2.2
keeps `rope` (its rotary tables), `time_embedder`, `scale_shift_table`, `norm1..3`). Everything else
floating, LoRA adapters included, is in the compute dtype (== --rollout-dtype whenever engines
run). Integer tensors keep their own dtype.

Engine (miles.models.loader), trainer (the data-parallel compute copy, FSDP2's per-parameter gather
dtype and its buffers: miles.backends.fsdp), push (miles.backends.weight_buckets' wire dtype, the
object-store copies) and checkpoint/export (the float32 master, which the rule never lowers) all ask
`held_dtype`; tests/unit/models/test_precision.py checks the three sides agree tensor by tensor.
"""

from __future__ import annotations

import torch

PARAMETER, BUFFER = "parameter", "buffer"


def kept_modules(module_or_class) -> tuple[str, ...]:
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    return tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())


def is_kept_in_float32(keep: tuple[str, ...], name: str) -> bool:
    """Whether a qualified tensor name lies in a module the class keeps in float32 (a PEFT wrapper's
    `base_model.model.` prefix and LoRA's `base_layer` parts change nothing: the match is by part)."""
    parts = name.split(".")
    return any(k in parts for k in keep)


def held_dtype(keep: tuple[str, ...], name: str, kind: str, built: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype engine and trainer forward hold tensor `name` in, and the push sends it in.

    `built`: the tensor's dtype as the class builds it (float32 for floating tensors); `compute`: the
    forward dtype (--compute-dtype == --rollout-dtype)."""
    if not built.is_floating_point or compute == built:
        return built
    if is_kept_in_float32(keep, name):
        return torch.float32
    return compute


def tensor_dtypes(module: torch.nn.Module, compute: torch.dtype) -> dict[str, torch.dtype]:
    """Every parameter's and buffer's held dtype by qualified name, for a module built in float32."""
    keep = kept_modules(module)
    out = {n: held_dtype(keep, n, PARAMETER, _built(p), compute) for n, p in module.named_parameters()}
    out.update({n: held_dtype(keep, n, BUFFER, _built(b), compute) for n, b in module.named_buffers()})
    return out


def _built(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.is_floating_point() else t.dtype


@torch.no_grad()
def cast_to_rule(module: torch.nn.Module, compute: torch.dtype, keep: tuple[str, ...] | None = None,
                 prefix: str = "") -> None:
    """Cast every parameter and buffer of `module` in place to its held dtype (`keep`: the owning
    class's kept modules when `module` is part of a bigger one, `prefix` its name there)."""
    keep = kept_modules(module) if keep is None else keep
    for sub_name, sub in module.named_modules():
        base = f"{prefix}{sub_name}." if sub_name else prefix
        for name, p in sub._parameters.items():
            if p is not None and p.is_floating_point():
                want = held_dtype(keep, base + name, PARAMETER, torch.float32, compute)
                if p.dtype != want:
                    sub._parameters[name] = torch.nn.Parameter(p.to(want), requires_grad=p.requires_grad)
        for name, b in sub._buffers.items():
            if b is not None and b.is_floating_point():
                want = held_dtype(keep, base + name, BUFFER, torch.float32, compute)
                if b.dtype != want:
                    sub._buffers[name] = b.to(want)


def wire_dtype(keep: tuple[str, ...], name: str, dtype: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """What a push sends tensor `name` (held by the sender in `dtype`) in: the engine's held dtype."""
    return held_dtype(keep, name, PARAMETER, torch.float32 if dtype.is_floating_point else dtype, compute)


def weight_digests(modules: dict[str, torch.nn.Module], held=None) -> dict[str, str]:
    """`<component>.<name>` -> "<dtype>:<crc32 of its bytes>" for every parameter and buffer, as held
    (`held(component, name, tensor)` gives the tensor a side computes with, default the tensor
    itself): two sides' digests differ exactly where a tensor's dtype or value does."""
    import zlib

    out = {}
    for component, module in modules.items():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            name = name.replace("base_model.model.", "")
            t = t.detach() if held is None else held(component, name, t)
            # a copy: numpy holding the tensor's own storage would pin it (offload resizes storages to 0)
            data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).clone().numpy().tobytes()
            out[f"{component}.{name}"] = f"{str(t.dtype).removeprefix('torch.')}:{zlib.crc32(data):08x}"
    return out


def differing(first: dict[str, str], second: dict[str, str]) -> list[str]:
    """The tensor names whose digests differ (or that one side lacks), each with both digests."""
    return [f"{n} ({first.get(n, 'absent')} vs {second.get(n, 'absent')})"
            for n in sorted(set(first) | set(second)) if first.get(n) != second.get(n)]
