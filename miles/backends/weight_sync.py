"""Which weights go from the trainer to the engines after an optimizer phase.

Full finetune sends every parameter of each updated transformer component; LoRA sends the
adapter pairs only (the base never changes). Keys are the component's own `named_parameters`
names, so the engine copies them into the same-named tensors in place.
`--update-weight-target-module` restricts the components (default: every transformer component).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from miles.backends.lora import is_lora_param
from miles.models.precision import kept_modules, wire_dtype


@dataclass
class WeightUpdate:
    """One component's new weights, CPU tensors keyed by parameter name (crosses to the engines)."""

    component: str
    state_dict: dict[str, torch.Tensor]
    lora_only: bool


def sync_components(transformer_components: tuple[str, ...], target_modules: list[str] | None) -> list[str]:
    if not target_modules:
        return list(transformer_components)
    unknown = [m for m in target_modules if m not in transformer_components]
    if unknown:
        raise ValueError(f"--update-weight-target-module {unknown} not among this family's transformer "
                         f"components {list(transformer_components)}")
    return [c for c in transformer_components if c in target_modules]


def synced_tensors(transformers: dict[str, torch.nn.Module], components: Iterable[str],
                   lora_only: bool) -> list[tuple[str, str, torch.Tensor]]:
    """(component, name, tensor) of every tensor a weight update carries, in a fixed order: the
    components in order, each one's `named_parameters()` (LoRA: the adapter tensors only)."""
    return [(component, name, p.detach()) for component in components
            for name, p in transformers[component].named_parameters() if not lora_only or is_lora_param(name)]


def wire_rule(transformers: dict[str, torch.nn.Module], compute: torch.dtype):
    """(component, name, sender dtype) -> the dtype the engine holds that tensor in
    (miles.models.precision): what a push sends it in, by bucket or through the object store."""
    keeps = {c: kept_modules(m) for c, m in transformers.items()}
    return lambda component, name, dtype: wire_dtype(keeps[component], name, dtype, compute)


def collect_weight_updates(transformers: dict[str, torch.nn.Module], components: list[str], lora_only: bool,
                           to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           wire=None) -> list[WeightUpdate]:
    """The update of each component as CPU copies; `to_host` makes one tensor's copy (default a
    plain copy; a sharded rank gathers first, one parameter at a time); `wire` (a `wire_rule`)
    casts each copy to the dtype the engine holds it in."""
    to_host = to_host or (lambda t: t.to("cpu", copy=True))
    states: dict[str, dict[str, torch.Tensor]] = {c: {} for c in components}
    for component, name, tensor in synced_tensors(transformers, components, lora_only):
        host = to_host(tensor)
        states[component][name] = host if wire is None else host.to(wire(component, name, host.dtype))
    return [WeightUpdate(c, states[c], lora_only) for c in components]


@torch.no_grad()
def apply_weight_update(module: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the same-named parameters in place; every key must exist."""
    params = dict(module.named_parameters())
    missing = [n for n in state_dict if n not in params]
    if missing:
        raise KeyError(f"weight update names {len(missing)} parameters the module lacks, e.g. {missing[:3]}")
    for name, tensor in state_dict.items():
        params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
