"""Which weights go from the trainer to the engines after an optimizer phase.

Full finetune sends every parameter of each updated transformer component; LoRA sends the
adapter pairs only (the base never changes). Keys are the component's own `named_parameters`
names, so the engine copies them into the same-named tensors in place.
`--update-weight-target-module` restricts the components (default: every transformer component).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.backends.lora import is_lora_param


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


def collect_weight_updates(transformers: dict[str, torch.nn.Module], components: list[str],
                           lora_only: bool) -> list[WeightUpdate]:
    updates = []
    for component in components:
        named = transformers[component].named_parameters()
        state = {n: p.detach().to("cpu", copy=True) for n, p in named if not lora_only or is_lora_param(n)}
        updates.append(WeightUpdate(component, state, lora_only))
    return updates


@torch.no_grad()
def apply_weight_update(module: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the same-named parameters in place; every key must exist."""
    params = dict(module.named_parameters())
    missing = [n for n in state_dict if n not in params]
    if missing:
        raise KeyError(f"weight update names {len(missing)} parameters the module lacks, e.g. {missing[:3]}")
    for name, tensor in state_dict.items():
        params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
