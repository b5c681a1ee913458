"""--lora-init-weights reaches PEFT: lora_A drawn from N(0, 1/rank) (flow_grpo's "gaussian") or
PEFT's kaiming-uniform, whose bound for these shapes is sqrt(6 / (6 fan_in)) = 0.125; lora_B zero."""

import torch
from peft import inject_adapter_in_model

from miles.backends.lora import LoraSpec

KAIMING_BOUND = (6 / (6 * 64)) ** 0.5  # kaiming_uniform_(a=sqrt(5)) on fan_in 64


def adapter_a(init: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("to_q", torch.nn.Linear(64, 64))
    inject_adapter_in_model(LoraSpec(rank=4, alpha=4, target_modules=("to_q",), init_weights=init).peft_config(),
                            model)
    return model.to_q.lora_A["default"].weight, model.to_q.lora_B["default"].weight


def test_gaussian_and_kaiming_init_draw_lora_a_from_their_distributions():
    a, b = adapter_a("gaussian")
    assert a.abs().max() > KAIMING_BOUND  # 256 draws at std 0.25: outside the kaiming bound
    assert 0.2 < float(a.std()) < 0.3 and not b.any()
    a, b = adapter_a("kaiming-uniform")
    assert a.abs().max() <= KAIMING_BOUND and not b.any()
