import json
import shutil

import pytest
import torch

from miles.models.loader import CheckpointError, load_model
from miles.models.registry import detect_family, get_family
from miles.models.tokenizer import build_tokenizer
from miles.diffusion_facts.families import FAMILY_NAMES
from miles.diffusion_facts.schedule import expert_index_for_step


def _inputs(model, batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cond = model.encode_prompts([f"a photo of {i} red cats" for i in range(batch)], "blurry")
    return torch.randn(batch, *model.latent_shape(32, 32, 5), generator=g), cond


def _assert_batch_and_autograd_invariant(model, expert=None):
    """The same batch gives the same bits with or without autograd or in inference mode, the unconditional branch
    detached or not (the trainer recomputing the engine's forward). Each sample alone is a forward of
    another shape, whose kernels may block their float32 sums differently: equal to the
    pipeline-parity tolerance (1e-5 relative), the bound a reassociated sum of a few thousand
    float32 terms through a handful of layers stays far below (~1e-6)."""
    x, cond = _inputs(model)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        rollout = model.velocity(x, sigma, cond, 4.0, expert)
    with torch.inference_mode():  # how the engine samples
        engine = model.velocity(x, sigma, cond, 4.0, expert)
    assert torch.equal(rollout, engine)
    with torch.enable_grad():
        train = model.velocity(x, sigma, cond, 4.0, expert, detach_uncond=True)
        both = model.velocity(x, sigma, cond, 4.0, expert)
        singles = [model.velocity(x[i : i + 1], sigma[i : i + 1], cond.select(i), 4.0, expert) for i in range(3)]
    assert torch.equal(rollout, train.detach()) and torch.equal(rollout, both.detach())
    alone = torch.cat(singles).detach()
    assert float((rollout - alone).abs().max() / rollout.abs().max()) <= 1e-5
    return rollout


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_velocity_is_identical_with_or_without_grad_and_close_to_each_sample_alone(family, tiny_checkpoint):
    model = load_model(tiny_checkpoint(family))
    for expert in model.transformers:
        out = _assert_batch_and_autograd_invariant(model, expert)
        assert out.shape[1:] == model.latent_shape(32, 32, 5) and out.dtype == torch.float32
    if len(model.transformers) > 1:  # sigmas on both sides of Wan2.2's boundary: one call per expert, rows in order
        mixed = _assert_batch_and_autograd_invariant(model, None)
        assert not torch.equal(mixed[0], _assert_batch_and_autograd_invariant(model, "transformer_2")[0])


def _randomize_lora(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_velocity_stays_invariant_with_peft_lora_injected(family, tiny_checkpoint):
    model = load_model(tiny_checkpoint(family))
    base = _assert_batch_and_autograd_invariant(model, model.spec.transformer_components[0])
    model.apply_lora(rank=4, alpha=8)
    for name in model.transformers:
        _randomize_lora(model.transformers[name], seed=1)
    with_lora = _assert_batch_and_autograd_invariant(model, model.spec.transformer_components[0])
    assert not torch.equal(base, with_lora)


def test_trainer_peft_model_and_engine_lora_give_identical_velocity(tiny_checkpoint):
    """Trainer: get_peft_model, grads on. Engine: injected adapters, weights pushed by load_weights."""
    from peft import LoraConfig, get_peft_model

    trainer = load_model(tiny_checkpoint("sd3"))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(trainer.spec.lora_target_modules))
    trainer.transformers["transformer"] = get_peft_model(trainer.transformers["transformer"], config)
    _randomize_lora(trainer.transformers["transformer"], seed=2)
    engine = load_model(tiny_checkpoint("sd3"))
    engine.apply_lora(rank=4, alpha=8)
    lora = {k: v for k, v in trainer.transformers["transformer"].state_dict().items() if "lora_" in k}
    engine.load_weights("transformer", lora)

    x, cond = _inputs(trainer)
    with torch.enable_grad():
        train = trainer.velocity(x, 0.6, cond, 4.0)
    with torch.no_grad():
        rollout = engine.velocity(x, 0.6, cond, 4.0)
    assert torch.equal(train.detach(), rollout)


def test_load_weights_rejects_unknown_tensors_and_wrong_shapes(tiny_checkpoint):
    model = load_model(tiny_checkpoint("sd3"))
    with pytest.raises(KeyError, match="no_such.weight"):
        model.load_weights("transformer", {"no_such.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="proj_out.weight"):
        model.load_weights("transformer", {"proj_out.weight": torch.zeros(1, 1)})


def test_load_weights_replaces_the_weights_used_by_velocity(tiny_checkpoint):
    model = load_model(tiny_checkpoint("sd3"))
    x, cond = _inputs(model)
    before = model.velocity(x, 0.5, cond, 4.0)
    state = {k: v + 0.01 for k, v in model.transformers["transformer"].state_dict().items()}
    model.load_weights("transformer", state)
    assert not torch.equal(before, model.velocity(x, 0.5, cond, 4.0))


def _text_encoder_calls(model, run):
    calls = []
    hook = model.text_encoders["text_encoder"].register_forward_hook(lambda *_: calls.append(1))
    try:
        return run(), len(calls)
    finally:
        hook.remove()


def test_the_negative_prompt_is_encoded_once_until_the_text_encoder_changes(tiny_checkpoint):
    """A run's negative prompt is the same in every call: encoded once and kept, with the bits a
    fresh encoding gives, and encoded again once a weight load changes the text encoder."""
    model = load_model(tiny_checkpoint("sd3"))
    fresh = load_model(tiny_checkpoint("sd3"))
    first, calls_first = _text_encoder_calls(model, lambda: model.encode_prompts(["a cat", "a cat"], "blurry"))
    again, calls_again = _text_encoder_calls(model, lambda: model.encode_prompts(["a dog"], "blurry"))
    assert (calls_first, calls_again) == (2, 1)  # each distinct text once; the kept negative not again
    expected = fresh.encode_prompts(["a dog"], "blurry")
    for k, v in expected.negative.items():
        assert torch.equal(first.negative[k][1:], v) and torch.equal(again.negative[k], v)

    state = {k: v + 0.01 for k, v in model.text_encoders["text_encoder"].state_dict().items() if v.is_floating_point()}
    model.load_weights("text_encoder", state)
    fresh.load_weights("text_encoder", state)
    changed, calls_changed = _text_encoder_calls(model, lambda: model.encode_prompts(["a dog"], "blurry"))
    assert calls_changed == 2
    for k, v in fresh.encode_prompts(["a dog"], "blurry").negative.items():
        assert torch.equal(changed.negative[k], v) and not torch.equal(v, expected.negative[k])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_is_detected_from_model_index(family, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(family)
    assert detect_family(path) == family
    index = json.loads((path / "model_index.json").read_text())
    del index["_miles_family"]  # a released checkpoint: only the pipeline class tells
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert detect_family(tmp_path) == family


def _copy(tiny_checkpoint, family, tmp_path):
    return shutil.copytree(tiny_checkpoint(family), tmp_path / "ck")


def test_missing_component_folder_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "wan2_2", tmp_path)
    shutil.rmtree(path / "transformer_2")
    with pytest.raises(CheckpointError, match="missing component 'transformer_2'"):
        load_model(path)


def test_component_absent_from_model_index_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "sd3", tmp_path)
    index = json.loads((path / "model_index.json").read_text())
    del index["vae"]
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="no 'vae' component"):
        load_model(path)


def test_family_mismatch_is_named(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="'sd3' checkpoint.*family 'wan2_2'"):
        load_model(tiny_checkpoint("sd3"), family="wan2_2")


def test_tensor_shape_mismatch_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "sd3", tmp_path)
    config_file = path / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config["caption_projection_dim"] = 48
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"component 'transformer'.*context_embedder|component 'transformer'.*shape"):
        load_model(path)


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="model_index.json is missing"):
        load_model(tmp_path)


def test_wan_experts_switch_at_the_boundary_like_the_validator(tiny_checkpoint):
    model = load_model(tiny_checkpoint("wan2_2"))
    assert model.expert_for(1.0) == model.expert_for(0.875) == "transformer"
    assert model.expert_for(0.8749) == model.expert_for(0.0) == "transformer_2"
    sigmas = model.sigmas(10)
    for k in range(10):
        want = ("transformer", "transformer_2")[expert_index_for_step(sigmas, k, 0.875)]
        assert model.expert_for_step(sigmas, k) == want == model.expert_for(sigmas[k])
    assert {model.expert_for_step(sigmas, k) for k in range(10)} == {"transformer", "transformer_2"}


def test_wan_vae_is_loaded_and_decodes_in_float32_under_bfloat16_as_the_pipeline_runs_it(tiny_checkpoint):
    model = load_model(tiny_checkpoint("wan2_2"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parts["vae"].parameters()} == {torch.float32}
    for name in ("transformer", "transformer_2"):  # bfloat16 but for the modules the class keeps in float32
        assert model.parts[name].proj_out.weight.dtype == torch.bfloat16
    assert model.parts["text_encoder"].dtype == torch.bfloat16
    # the decoded frames are float32 VAE output: an SD3 VAE (no such rule) follows the load dtype
    frames = model.decode(torch.randn(1, *model.latent_shape(32, 32, 5)))
    assert torch.isfinite(frames).all()
    assert load_model(tiny_checkpoint("sd3"), dtype=torch.bfloat16).parts["vae"].dtype == torch.bfloat16
    meta = load_model(tiny_checkpoint("wan2_2"), device="meta", dtype=torch.bfloat16)  # what a replay builds
    assert meta.parts["vae"].dtype == torch.float32


def test_unguided_family_has_no_negative_conditioning(tiny_checkpoint):
    assert get_family("ltx").guided is False
    cond = load_model(tiny_checkpoint("ltx")).encode_prompts(["a cat"], "blurry")
    assert cond.negative is None


def test_schedule_comes_from_the_scheduler_config_unless_overridden(tiny_checkpoint, caplog):
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = load_model(tiny_checkpoint("sd3"))
    reference = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_checkpoint("sd3") / "scheduler")
    reference.set_timesteps(6)
    assert model.sigmas(6) == reference.sigmas.tolist()
    assert model.sigmas(6, shift=3.0) == model.sigmas(6) and not caplog.records  # same config: no warning
    reference = FlowMatchEulerDiscreteScheduler(shift=1.0)
    reference.set_timesteps(2)
    assert model.sigmas(2, shift=1.0) == reference.sigmas.tolist()
    assert "overrides the scheduler" in caplog.text


def test_tokenizer_covers_any_ascii_prompt_and_pads_to_fixed_length():
    tok = build_tokenizer(16)
    ids = tok('Sign reads "HELLO-42"!', padding="max_length", max_length=16, truncation=True).input_ids
    assert tok.unk_token_id not in ids and len(ids) == 16
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids
