"""Exported weights, loaded into the family's own diffusers pipeline, sample what our engine
samples from the checkpoint.

For every family's tiny checkpoint, LoRA and full: a run's checkpoint (saved by the trainer's own
save) is exported; the engine gets the checkpoint's tensors as weight sync would give them
(`load_weights`, after `apply_lora` for a LoRA), the pipeline gets the export (full:
`from_pretrained(export)` of the --pipeline folder; LoRA: the base pipeline plus
`load_lora_weights`, or `transformer.load_lora_adapter` where the pipeline has no LoRA loader,
Cosmos2). Both run from the engine's initial latents at noise level 0.

The bound, 1e-5 relative in fp32, is the pipeline-parity bound of
tests/unit/models/test_pipeline_parity.py, inherited: the export moves bytes (the full case checks
the exported tensors equal the checkpoint's bit for bit; a LoRA loads into the same PEFT layers
with the same r and alpha), so both sides run the same fp32 forwards on the same weights and
differ only in the scheduler arithmetic around them, which that test holds to 1e-5 on any IEEE
fp32 machine (per step a few ulp, 2^-23 ~ 1.2e-7 relative, of the update x + dt v; Cosmos2's EDM
coordinates, x / (1 - t), amplify it most: ~5e-6 there, <= 1e-6 for the other families).
A LoRA loaded with diffusers' default alpha (= rank, here half of 8) or not loaded at all moves the
result by far more than the bound, so the comparison can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from export_runs import export, make_run
from miles.backends import checkpoint as ckpt
from miles.rollout.engine import RolloutEngine
from miles.rollout.types import SampleRequest, SamplingParams
from tests.unit.models.test_pipeline_parity import (CASES, EDM_FAMILIES, PROMPT, SIZE, pipeline_of, relative_diff,
                                                     sd3_embeds)

FAMILIES = sorted(CASES)
NUM_STEPS = 2


def engine_from_checkpoint(base: Path, family: str, checkpoint: Path, lora) -> RolloutEngine:
    ours = CASES[family][0]
    params = SamplingParams(num_steps=NUM_STEPS, height=SIZE, width=SIZE, noise_level=0.0, **ours)
    return with_checkpoint(RolloutEngine(base, params, num_threads=1), checkpoint, lora)


def with_checkpoint(engine: RolloutEngine, checkpoint: Path, lora) -> RolloutEngine:
    """The engine given a trainer checkpoint's tensors as weight sync gives them (LoRA: adapters first)."""
    components = sorted(p.name[len("model_"):-len(".safetensors")] for p in checkpoint.glob("model_*.safetensors"))
    if lora is not None:
        engine.apply_lora(lora.rank, lora.alpha, list(lora.target_modules), components)
    for component in components:
        engine.load_weights(component, ckpt.load_tensors(checkpoint / f"model_{component}.safetensors"))
    return engine


def pipeline_sample(pipe, base: Path, family: str, trajectory) -> float:
    """The pipeline's final latents from the trajectory's start, against the trajectory's end."""
    _, call, layout = CASES[family]
    start, final = trajectory.latents[0].unsqueeze(0), trajectory.latents[-1].unsqueeze(0)
    if family in EDM_FAMILIES:
        sigmas = trajectory.sigmas.tolist()
        start, final = start / sigmas[0], final / (1.0 - sigmas[-1])
    if family == "sd3" and "text_encoder_2" not in json.loads((base / "model_index.json").read_text()):
        call = {**call, **sd3_embeds(trajectory.cond), "negative_prompt": None}
    call = {"prompt": PROMPT, **call}
    with torch.no_grad():
        out = pipe(num_inference_steps=NUM_STEPS, height=SIZE, width=SIZE,
                   latents=layout(start.clone()), output_type="latent", **call)
    ref = out.images if hasattr(out, "images") else out.frames
    ours = layout(final)
    return relative_diff(ours, ref.reshape(ours.shape) if ref.numel() == ours.numel() else ref)


def load_lora_into(pipe, export_dir: Path) -> None:
    for path in sorted(export_dir.glob("pytorch_lora_weights*.safetensors")):
        second = path.stem.endswith("_transformer_2")
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(str(export_dir), weight_name=path.name,
                                   **({"load_into_transformer_2": True} if second else {}))
        else:  # Cosmos2TextToImagePipeline has no LoRA loader mixin; its transformer loads the same file
            pipe.transformer.load_lora_adapter(str(export_dir), weight_name=path.name, prefix="transformer")


def round_trip(tmp_path, tiny_checkpoint, family: str, lora: bool) -> tuple[float, float]:
    """(relative difference to the exported pipeline, relative difference to the base pipeline)."""
    base = tiny_checkpoint(family)
    run_dir, rank = make_run(tmp_path / "run", base, family, lora=lora)
    out = tmp_path / "export"
    assert export(run_dir, "--out", out, *([] if lora else ["--pipeline"])) == 0
    checkpoint = ckpt.latest_checkpoint(run_dir / "checkpoints")[1]
    engine = engine_from_checkpoint(base, family, checkpoint, rank.lora)
    trajectory = engine.generate([SampleRequest(PROMPT, 0, 0, seed=7)], trained_steps=[])[0]
    base_pipe = pipeline_of(base)
    to_base = pipeline_sample(base_pipe, base, family, trajectory)
    if lora:
        load_lora_into(base_pipe, out)
        exported = base_pipe
    else:
        exported = pipeline_of(out)
        for component in rank.components:
            saved = ckpt.load_tensors(checkpoint / f"model_{component}.safetensors")
            state = getattr(exported, component).state_dict()
            assert all(torch.equal(state[n], t) for n, t in saved.items())
    return pipeline_sample(exported, base, family, trajectory), to_base


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_exported_weights_in_the_diffusers_pipeline_sample_what_the_engine_samples(
        family, lora, tmp_path, tiny_checkpoint):
    exported, base = round_trip(tmp_path, tiny_checkpoint, family, lora)
    assert exported <= 1e-5
    assert base > 1e-3  # the trained weights matter: the base pipeline alone samples something else
