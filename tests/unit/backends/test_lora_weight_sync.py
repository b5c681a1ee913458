import pytest
import torch

from miles.backends.lora import LoraSpec, adapters_disabled, attach_lora
from miles.backends.weight_sync import apply_weight_update, collect_weight_updates, sync_components


def tiny_transformer():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                 caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=16)


def forward(model):
    torch.manual_seed(1)
    return model(hidden_states=torch.randn(1, 4, 8, 8), timestep=torch.tensor([500.0]),
                 encoder_hidden_states=torch.randn(1, 4, 16), pooled_projections=torch.randn(1, 16),
                 return_dict=False)[0]


SPEC = LoraSpec(rank=2, alpha=2, target_modules=("to_q", "to_k", "to_v"))


def test_lora_trains_only_the_adapters_and_starts_equal_to_the_base():
    model = tiny_transformer()
    base = forward(model)
    attach_lora(model, SPEC)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert torch.equal(forward(model), base)


def test_disabling_adapters_gives_back_the_base_model():
    model = tiny_transformer()
    base = forward(model)
    attach_lora(model, SPEC)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.fill_(0.5)
    assert not torch.equal(forward(model), base)
    with adapters_disabled([model]):
        assert torch.equal(forward(model), base)
    assert not torch.equal(forward(model), base)


def test_lora_update_carries_only_adapter_tensors_and_lands_in_place():
    trainer, engine = tiny_transformer(), tiny_transformer()
    attach_lora(trainer, SPEC)
    attach_lora(engine, SPEC)
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if ".lora_B." in n:
                p.normal_()
    (update,) = collect_weight_updates({"transformer": trainer}, ["transformer"], lora_only=True)
    assert update.state_dict and all(".lora_" in k for k in update.state_dict)
    before = {n: p for n, p in engine.named_parameters()}
    apply_weight_update(engine, update.state_dict)
    assert all(before[n] is p for n, p in engine.named_parameters())  # same tensors, new values
    assert torch.equal(forward(engine), forward(trainer))


def test_full_update_carries_every_parameter():
    trainer, engine = tiny_transformer(), tiny_transformer()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    (update,) = collect_weight_updates({"transformer": trainer}, ["transformer"], lora_only=False)
    assert set(update.state_dict) == {n for n, _ in trainer.named_parameters()}
    apply_weight_update(engine, update.state_dict)
    assert torch.equal(forward(engine), forward(trainer))


def test_update_naming_an_unknown_tensor_is_an_error():
    with pytest.raises(KeyError, match="lacks"):
        apply_weight_update(tiny_transformer(), {"nope.weight": torch.zeros(1)})


def test_sync_components_default_to_every_transformer_and_reject_unknown_names():
    assert sync_components(("transformer", "transformer_2"), None) == ["transformer", "transformer_2"]
    assert sync_components(("transformer", "transformer_2"), ["transformer_2"]) == ["transformer_2"]
    with pytest.raises(ValueError, match="update-weight-target-module"):
        sync_components(("transformer",), ["vae"])
