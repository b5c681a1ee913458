"""At noise level 0 the sampler reproduces LTX2Pipeline on our tiny ltx2 checkpoint (DESIGN 5).

Our sampler's state is one tensor holding the video and the audio tokens
(miles/models/families/ltx2.py); it is split into the pipeline's packed video latents and packed
audio latents, which LTX2Pipeline is given as `latents` / `audio_latents` (3-D: taken as they are,
the audio ones after its normalisation, which the test undoes first). The pipeline runs as the
recipe trains, unguided: guidance 1, STG 0, modality guidance 1, guidance rescale 0, for video
and audio alike, so it makes one transformer call per step as our sampler does. It encodes the
prompt itself (Gemma, then the connectors), from the same checkpoint.

Compared: the final video and audio latents, denormalised and unpacked by the pipeline
(`output_type="latent"`), and the decoded frames (`output_type="pt"`). Our checkpoints ship no
vocoder (the rewards read frames); the pipeline's pixel path vocodes the audio, so it is given a
tiny random LTX2Vocoder whose output nobody reads.

The bound, 1e-5 relative in fp32 as for every family (tests/unit/models/test_pipeline_parity.py),
holds on any CPU because both sides run the same modules on the same inputs in the same order, in
fp32: the only differences left are in the last bits of a reduction, where the pipeline encodes
`num_videos_per_prompt` copies of the prompt in one batch and the engine encodes it once and
repeats it, and where a CPU's vector width or GEMM blocking (ATEN_CPU_CAPABILITY) orders the sums
of a matmul differently. Each such difference is a few fp32 ulps (~1e-7 relative) of one
activation; through these few steps of a tiny, well-conditioned network they stay two orders of
magnitude below the bound. (Measured here: exactly 0.0, with and without ATEN_CPU_CAPABILITY=default.)
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.test_pipeline_parity import PROMPT, relative_diff
from miles.rollout.engine import RolloutEngine
from miles.rollout.types import SampleRequest, SamplingParams

SIZE, FRAMES = 32, 5  # the tiny VAE compresses 16x, 4x: a 2 x 2 x 2 video grid and 5 audio latent frames
UNGUIDED = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=1.0,
                audio_stg_scale=0.0, audio_modality_scale=1.0, audio_guidance_rescale=0.0)


def tiny_vocoder(audio_vae):
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    torch.manual_seed(0)
    mel_in = audio_vae.config.output_channels * audio_vae.config.mel_bins
    return LTX2Vocoder(in_channels=mel_in, hidden_channels=8, upsample_kernel_sizes=[4], upsample_factors=[2],
                       resnet_kernel_sizes=[3], resnet_dilations=[[1]]).eval()


def run(path, num_steps, batch):
    """(relative diffs of the video latents, the audio latents, the frames)."""
    params = SamplingParams(num_steps=num_steps, height=SIZE, width=SIZE, num_frames=FRAMES, noise_level=0.0,
                            guidance_scale=1.0)
    engine = RolloutEngine(path, params, num_threads=1)  # one microgroup of `batch` samples, as engine_run
    trajectories = engine.generate([SampleRequest(PROMPT, 0, j, seed=7 + j) for j in range(batch)], trained_steps=[])
    model = engine.model
    module, parts = model.spec.module, model.parts
    start = torch.stack([t.latents[0] for t in trajectories])
    final = torch.stack([t.latents[-1] for t in trajectories])
    frames = torch.stack([t.image for t in trajectories])
    video0, audio0 = module.split(parts, start)
    video1, audio1 = module.split(parts, final)
    vae, audio_vae = parts["vae"], parts["audio_vae"]

    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(path), torch_dtype=torch.float32, vocoder=tiny_vocoder(audio_vae))
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=PROMPT, num_inference_steps=num_steps, height=SIZE, width=SIZE, num_frames=FRAMES,
                num_videos_per_prompt=batch, return_dict=False, **UNGUIDED)
    with torch.no_grad():
        # the pipeline normalises given audio latents with the audio VAE's statistics: undo that first
        audio_in = audio0 * audio_vae.latents_std + audio_vae.latents_mean
        ref_video, ref_audio = pipe(latents=video0.clone(), audio_latents=audio_in, output_type="latent", **call)
        ref_frames, _ = pipe(latents=video0.clone(), audio_latents=audio_in.clone(), output_type="pt", **call)

    f, h, w, _, na = module.geometry(parts, final.shape)
    ours_video = video1.reshape(batch, f, h, w, -1).permute(0, 4, 1, 2, 3)
    ours_video = (ours_video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor
                  + vae.latents_mean.view(1, -1, 1, 1, 1))
    ours_audio = (audio1 * audio_vae.latents_std + audio_vae.latents_mean).unflatten(2, (-1, ref_audio.shape[-1]))
    ours_audio = ours_audio.transpose(1, 2)  # [B, L, C, M] -> the pipeline's [B, C, L, M]
    return (relative_diff(ours_video, ref_video), relative_diff(ours_audio, ref_audio),
            relative_diff(frames, ref_frames.float()))


@pytest.mark.parametrize("num_steps,batch", [(2, 1), (7, 1), (4, 3)])
def test_ltx2_engine_at_noise_level_0_matches_ltx2pipeline(num_steps, batch, tiny_checkpoint):
    diffs = run(tiny_checkpoint("ltx2"), num_steps, batch)
    print(f"ltx2 parity, {num_steps} steps, batch {batch}: video/audio latents, frames rel diff {diffs}")
    assert max(diffs) <= 1e-5


def test_ltx2_state_splits_and_joins_back(tiny_checkpoint):
    """The joint state's layout: video columns, then audio tokens in order, then zero padding."""
    from miles.models.loader import load_model

    model = load_model(tiny_checkpoint("ltx2"))
    module, parts = model.spec.module, model.parts
    shape = model.latent_shape(SIZE, SIZE, FRAMES)
    f, h, w, r, na = module.geometry(parts, shape)
    assert (f, h, w, na) == (2, 2, 2, 5) and shape == (f, h, w + r, 8) and f * h * r >= na > f * h * (r - 1)
    x = torch.randn(3, *shape)
    video, audio = module.split(parts, x)
    assert video.shape == (3, f * h * w, 8) and audio.shape == (3, na, 8)
    joined = module.join(parts, video, audio, x.shape)
    assert torch.equal(joined[:, :, :, :w], x[:, :, :, :w])
    slots = joined[:, :, :, w:].reshape(3, -1, 8)
    assert torch.equal(slots[:, :na], audio) and not slots[:, na:].any()
    with pytest.raises(ValueError, match="k \\* 4 \\+ 1"):
        model.latent_shape(SIZE, SIZE, 6)


def released_ltx2(root, tiny):
    """An ltx2 directory in the released layout (diffusers/LTX-2.3-Diffusers'): the text encoder a
    whole Gemma3ForConditionalGeneration (a tiny SigLIP tower beside the text model of `tiny`'s
    width and depth), and a vocoder the model index names under the pipeline's own library,
    ["ltx2", ...]; no `_miles_family`, so the loader detects the family from LTX2Pipeline."""
    import json
    import shutil

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    shutil.copytree(tiny, root)
    text = json.loads((tiny / "text_encoder" / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")
    config = Gemma3Config(text_config={k: text[k] for k in keys}, mm_tokens_per_image=4,
                          vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, patch_size=14, image_size=28))
    torch.manual_seed(0)
    shutil.rmtree(root / "text_encoder")
    Gemma3ForConditionalGeneration(config).save_pretrained(root / "text_encoder")
    from miles.models.loader import load_model

    tiny_vocoder(load_model(tiny).parts["audio_vae"]).save_pretrained(root / "vocoder")
    index = json.loads((tiny / "model_index.json").read_text())
    index.pop("_miles_family")
    index.update(text_encoder=["transformers", "Gemma3ForConditionalGeneration"], vocoder=["ltx2", "LTX2Vocoder"])
    (root / "model_index.json").write_text(json.dumps(index))
    return root


@pytest.fixture(scope="module")
def released_ltx2_dir(tmp_path_factory, tiny_checkpoint):
    return released_ltx2(tmp_path_factory.mktemp("released") / "ltx2", tiny_checkpoint("ltx2"))


def test_released_layout_ltx2_matches_the_pipeline_and_holds_what_it_names(released_ltx2_dir):
    from miles.models.loader import load_model

    from miles.records.checkpoint_layout import missing_parts, pixel_grid

    assert missing_parts(released_ltx2_dir, ("vae", "transformer", "connectors", "audio_vae")) == []
    assert pixel_grid(released_ltx2_dir).spatial == 16 and pixel_grid(released_ltx2_dir).frames_ok(FRAMES)
    model = load_model(released_ltx2_dir)
    assert model.family == "ltx2" and type(model.parts["vocoder"]).__name__ == "LTX2Vocoder"
    assert type(model.parts["text_encoder"]).__name__ == "Gemma3ForConditionalGeneration"
    diffs = run(released_ltx2_dir, 3, 2)
    print(f"ltx2 released layout parity: video/audio latents, frames rel diff {diffs}")
    assert max(diffs) <= 1e-5
