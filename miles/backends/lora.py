"""LoRA through PEFT, the way diffusers attaches it (`ModelMixin.add_adapter`).

The adapter is injected into the transformer in place, so the module keeps its class and the
family's forward still calls it unchanged; disabling the adapter gives back the base model,
which is the KL reference under `--diffusion-kl-reference lora_base`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

ADAPTER_NAME = "default"


@dataclass(frozen=True)
class LoraSpec:
    """What an engine needs to attach the same adapter (crosses to the engine actors)."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    init_weights: str = "gaussian"  # --lora-init-weights

    def peft_config(self):
        from peft import LoraConfig

        # either init leaves lora_B at zero: the adapted model starts equal to the base; lora_A is drawn
        # from N(0, 1/rank) ("gaussian", flow_grpo's) or PEFT's default kaiming-uniform
        init = "gaussian" if self.init_weights == "gaussian" else True
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                          init_lora_weights=init)


def lora_spec_from_args(args, family_facts) -> LoraSpec | None:
    if not args.use_lora:
        return None
    rank = args.lora_rank or 32
    return LoraSpec(rank=rank, alpha=args.lora_alpha or rank,
                    target_modules=tuple(args.lora_target_modules or family_facts.lora_target_modules),
                    init_weights=getattr(args, "lora_init_weights", "gaussian"))


def attach_lora(module: torch.nn.Module, spec: LoraSpec) -> None:
    """Inject the adapter; afterwards only the LoRA weights require grad."""
    module.add_adapter(spec.peft_config(), adapter_name=ADAPTER_NAME)
    for name, p in module.named_parameters():
        p.requires_grad_(is_lora_param(name))


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@contextmanager
def adapters_disabled(modules: list[torch.nn.Module]) -> Iterator[None]:
    for m in modules:
        m.disable_adapters()
    try:
        yield
    finally:
        for m in modules:
            m.enable_adapters()
