"""ltx2: exported weights, loaded into LTX2Pipeline, sample what our engine samples (the
round trip of test_round_trip.py, whose cases are the families of test_pipeline_parity.py; ltx2's
pipeline call and its two latent streams are test_ltx2_parity.py's).

A run's checkpoint (saved by the trainer's own save) is exported; the engine gets the checkpoint's
tensors as weight sync would give them, the pipeline the export (full: `from_pretrained` of the
--pipeline folder; LoRA: the base pipeline plus `load_lora_weights`). Both run unguided at noise
level 0 from the engine's initial video and audio latents. The bound is the parity tests', 1e-5
relative in fp32: the export moves bytes, so both sides run the same fp32 forwards on the same
weights (see test_ltx2_parity.py for why that bound holds on any CPU).
"""

from __future__ import annotations

import pytest
import torch

from export_runs import export, make_run
from miles.backends import checkpoint as ckpt
from test_round_trip import load_lora_into, with_checkpoint
from tests.unit.models.test_ltx2_parity import FRAMES, SIZE, UNGUIDED, tiny_vocoder
from tests.unit.models.test_pipeline_parity import PROMPT, relative_diff

NUM_STEPS = 2


def pipeline_final(pipe, engine, trajectory) -> float:
    """The pipeline's final video and audio latents from the trajectory's start, against its end."""
    module, parts = engine.model.spec.module, engine.model.parts
    video0, audio0 = module.split(parts, trajectory.latents[0].unsqueeze(0))
    video1, audio1 = module.split(parts, trajectory.latents[-1].unsqueeze(0))
    vae, audio_vae = parts["vae"], parts["audio_vae"]
    with torch.no_grad():  # the pipeline normalises given audio latents: undone first, as in test_ltx2_parity
        ref_video, ref_audio = pipe(prompt=PROMPT, num_inference_steps=NUM_STEPS, height=SIZE, width=SIZE,
                                    num_frames=FRAMES, latents=video0.clone(),
                                    audio_latents=audio0 * audio_vae.latents_std + audio_vae.latents_mean,
                                    output_type="latent", return_dict=False, **UNGUIDED)
    f, h, w, _, _ = module.geometry(parts, trajectory.latents[-1].unsqueeze(0).shape)
    ours_video = video1.reshape(1, f, h, w, -1).permute(0, 4, 1, 2, 3)  # denormalised as the pipeline returns it
    ours_video = (ours_video * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor
                  + vae.latents_mean.view(1, -1, 1, 1, 1))
    ours_audio = (audio1 * audio_vae.latents_std + audio_vae.latents_mean).unflatten(2, (-1, ref_audio.shape[-1]))
    ours_audio = ours_audio.transpose(1, 2)
    return max(relative_diff(ours_video, ref_video), relative_diff(ours_audio, ref_audio))


def ltx2_pipeline(path, vocoder):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(path), torch_dtype=torch.float32, vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_exported_ltx2_weights_in_ltx2pipeline_sample_what_the_engine_samples(lora, tmp_path, tiny_checkpoint):
    from miles.rollout.engine import RolloutEngine
    from miles.rollout.types import SampleRequest, SamplingParams

    base = tiny_checkpoint("ltx2")
    run_dir, rank = make_run(tmp_path / "run", base, "ltx2", lora=lora)
    out = tmp_path / "export"
    assert export(run_dir, "--out", out, *([] if lora else ["--pipeline"])) == 0
    checkpoint = ckpt.latest_checkpoint(run_dir / "checkpoints")[1]
    params = SamplingParams(num_steps=NUM_STEPS, height=SIZE, width=SIZE, num_frames=FRAMES, noise_level=0.0,
                            guidance_scale=1.0)
    engine = with_checkpoint(RolloutEngine(base, params, num_threads=1), checkpoint, rank.lora)
    trajectory = engine.generate([SampleRequest(PROMPT, 0, 0, seed=7)], trained_steps=[])[0]
    vocoder = tiny_vocoder(engine.model.parts["audio_vae"])
    base_pipe = ltx2_pipeline(base, vocoder)
    to_base = pipeline_final(base_pipe, engine, trajectory)
    if lora:
        load_lora_into(base_pipe, out)
        exported = base_pipe
    else:
        exported = ltx2_pipeline(out, vocoder)
        saved = ckpt.load_tensors(checkpoint / "model_transformer.safetensors")
        state = exported.transformer.state_dict()
        assert all(torch.equal(state[n], t) for n, t in saved.items())
    diff = pipeline_final(exported, engine, trajectory)
    print(f"ltx2 export round trip ({'lora' if lora else 'full'}): exported {diff}, base {to_base}")
    assert diff <= 1e-5
    assert to_base > 1e-3  # the trained weights matter: the base pipeline alone samples something else


