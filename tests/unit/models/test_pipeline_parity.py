"""At noise level 0 the project's sampler reproduces each family's diffusers pipeline (DESIGN 5).

The pipeline class named in the checkpoint's model_index.json is loaded from the same directory
and run with `output_type="latent"` from the engine's own initial latents; the engine's final
latents must match to 1e-5 relative in fp32.

Cosmos2TextToImagePipeline samples in EDM coordinates (miles/models/families/cosmos3.py): it is
given the engine's noise (it scales it by sigma_max itself) and its x_edm is compared with the
engine's x / (1 - t_final). It refuses to run without NVIDIA's guardrail package, which is not
installable offline; a stand-in that passes every prompt and frame is given instead.
"""

from __future__ import annotations

import inspect
import json

import diffusers
import pytest
import torch

from miles.models.families.qwen_image import pack
from miles.rollout.engine import RolloutEngine
from miles.rollout.types import Conditioning, SampleRequest, SamplingParams

PROMPT = "a red  cat"  # the double space exercises Wan's prompt_clean
SIZE = 32


class PassingGuardrail:
    """Stands in for cosmos_guardrail.CosmosSafetyChecker (not installable offline): every prompt passes."""

    def to(self, device):
        return self

    def check_text_safety(self, prompt):
        return True

    def check_video_safety(self, video):
        return video


def pipeline_of(path):
    """The pipeline model_index.json names, its components absent from the checkpoint set to None."""
    index = json.loads((path / "model_index.json").read_text())
    cls = getattr(diffusers, index["_class_name"])
    absent = {k: None for k in inspect.signature(cls.__init__).parameters if k != "self" and k not in index}
    if "safety_checker" in absent:
        absent["safety_checker"] = PassingGuardrail()
    pipe = cls.from_pretrained(str(path), torch_dtype=torch.float32, **absent)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def engine_run(path, params: SamplingParams, batch: int = 1):
    """`batch` samples of the prompt, one microgroup: the engine forwards them together, as the
    pipeline forwards its `num_images_per_prompt` images."""
    engine = RolloutEngine(path, params, num_threads=1)
    return engine.generate([SampleRequest(PROMPT, 0, j, seed=7 + j) for j in range(batch)], trained_steps=[])


def sd3_embeds(cond):
    """Our SD3 checkpoints have one CLIP, which StableDiffusion3Pipeline cannot encode with (it
    always runs two); it takes the embeddings instead. The encoders are compared on the
    released-layout checkpoint below."""
    pos, neg = cond.positive, cond.negative
    return dict(prompt=None, prompt_embeds=pos["encoder_hidden_states"], pooled_prompt_embeds=pos["pooled_projections"],
                negative_prompt_embeds=neg["encoder_hidden_states"],
                negative_pooled_prompt_embeds=neg["pooled_projections"])


def relative_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _video_latent_frames(engine, frames):
    return engine.model.latent_shape(SIZE, SIZE, frames)[1]


# family -> (SamplingParams overrides, pipeline call kwargs, latents to the pipeline's layout)
CASES = {
    "sd3": (dict(guidance_scale=7.0), dict(guidance_scale=7.0, negative_prompt=""), lambda x: x),
    "qwen_image": (dict(guidance_scale=4.0), dict(true_cfg_scale=4.0, negative_prompt=""), pack),
    "wan2_2": (dict(guidance_scale=5.0, guidance_scale_2=3.0, num_frames=5),
               dict(guidance_scale=5.0, guidance_scale_2=3.0, negative_prompt="", num_frames=5), lambda x: x),
    # LTX is unguided in this project: the pipeline runs with guidance_scale=1
    "ltx": (dict(num_frames=9), dict(guidance_scale=1.0, num_frames=9),
            lambda x: x.permute(0, 2, 3, 4, 1).flatten(1, 3)),
    "cosmos3": (dict(guidance_scale=4.0), dict(guidance_scale=4.0, negative_prompt=""), lambda x: x.unsqueeze(2)),
}
EDM_FAMILIES = ("cosmos3",)


def run_parity(path, family, num_steps, batch: int = 1, **param_overrides):
    ours, call, layout = CASES[family]
    params = SamplingParams(num_steps=num_steps, height=SIZE, width=SIZE, noise_level=0.0, **{**ours, **param_overrides})
    trajectories = engine_run(path, params, batch)
    trajectory = trajectories[0]
    start = torch.stack([t.latents[0] for t in trajectories])
    final = torch.stack([t.latents[-1] for t in trajectories])
    if family in EDM_FAMILIES:  # the pipeline's noise and its x_edm (see the module docstring)
        sigmas = trajectory.sigmas.tolist()
        start, final = start / sigmas[0], final / (1.0 - sigmas[-1])
    pipe = pipeline_of(path)
    per_prompt = "num_videos_per_prompt" if family in ("wan2_2", "ltx") else "num_images_per_prompt"
    call = {"prompt": PROMPT, **call, per_prompt: batch}
    if family == "sd3" and "text_encoder_2" not in json.loads((path / "model_index.json").read_text()):
        # given embeddings, the pipeline's batch is theirs: one row per sample
        call = {**call, **sd3_embeds(Conditioning.cat([t.cond for t in trajectories])), "negative_prompt": None,
                per_prompt: 1}
    with torch.no_grad():
        out = pipe(num_inference_steps=num_steps, height=SIZE, width=SIZE, latents=layout(start.clone()),
                   output_type="latent", **call)
    ref = out.images if hasattr(out, "images") else out.frames
    ours = layout(final)
    # Cosmos takes [B, C, 1, H, W] latents and returns images' latents without the frame axis
    return relative_diff(ours, ref.reshape(ours.shape) if ref.numel() == ours.numel() else ref)


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("num_steps", [2, 7])  # shift_terminal schedules (Qwen, LTX) need 2 or more
def test_engine_at_noise_level_0_matches_the_pipeline(family, num_steps, tiny_checkpoint):
    assert run_parity(tiny_checkpoint(family), family, num_steps) <= 1e-5


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_batched_microgroup_matches_the_pipeline_at_that_batch(family, tiny_checkpoint):
    """Three samples forwarded together by the engine, three images per prompt by the pipeline."""
    assert run_parity(tiny_checkpoint(family), family, 4, batch=3) <= 1e-5


def released_sd3(root, tiny_sd3):
    """An SD3 directory in the released layout, from transformers' own classes: two CLIP encoders
    with CLIPTokenizers (a small vocab and merges), a T5 encoder with a T5TokenizerFast."""
    import shutil
    import string

    from diffusers import SD3Transformer2DModel
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel,
                              T5TokenizerFast)

    chars = list(string.ascii_lowercase)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    vocab.update({"ca": len(vocab), "cat</w>": len(vocab) + 1})
    (root / "bpe").mkdir(parents=True)
    (root / "bpe" / "vocab.json").write_text(json.dumps(vocab))
    (root / "bpe" / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\n")
    torch.manual_seed(0)
    for suffix in ("", "_2"):
        CLIPTokenizer(str(root / "bpe" / "vocab.json"), str(root / "bpe" / "merges.txt"),
                      model_max_length=77).save_pretrained(root / f"tokenizer{suffix}")
        CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            projection_dim=16, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )).save_pretrained(root / f"text_encoder{suffix}")
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("▁" + c, -2.5) for c in chars]
    T5TokenizerFast(vocab=pieces, extra_ids=0).save_pretrained(root / "tokenizer_3")
    T5EncoderModel(T5Config(vocab_size=len(pieces), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                            relative_attention_num_buckets=8, decoder_start_token_id=0)).save_pretrained(root / "text_encoder_3")
    SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                          num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                          pooled_projection_dim=32, pos_embed_max_size=32).save_pretrained(root / "transformer")
    for name in ("vae", "scheduler"):
        shutil.copytree(tiny_sd3 / name, root / name)
    index = json.loads((tiny_sd3 / "model_index.json").read_text())
    index.pop("_miles_family")
    index.update({f"tokenizer{s}": ["transformers", "CLIPTokenizer"] for s in ("", "_2")})
    index.update({f"text_encoder{s}": ["transformers", "CLIPTextModelWithProjection"] for s in ("", "_2")})
    index.update(tokenizer_3=["transformers", "T5TokenizerFast"], text_encoder_3=["transformers", "T5EncoderModel"])
    (root / "model_index.json").write_text(json.dumps(index))
    return root


@pytest.fixture(scope="module")
def released_sd3_dir(tmp_path_factory, tiny_checkpoint):
    return released_sd3(tmp_path_factory.mktemp("released") / "sd3", tiny_checkpoint("sd3"))


@pytest.mark.parametrize("num_steps", [2, 6])
def test_released_layout_sd3_matches_the_pipeline_encoders_included(num_steps, released_sd3_dir):
    assert run_parity(released_sd3_dir, "sd3", num_steps) <= 1e-5
