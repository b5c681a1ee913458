"""The model card's "How to load" runs as written: it loads the export and samples a prompt.

The tiny SD3 has one CLIP and no T5, which StableDiffusion3Pipeline cannot load or encode with
by itself; the card's code is cut from the exported README.md and executed unchanged, and its
sample must come out of the trained weights (it differs from the base pipeline's sample of the
same code on the base, which a card that ignored the export would not).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from export_runs import export, make_run

SMALL = ("--diffusion-height", "32", "--diffusion-width", "32", "--diffusion-num-steps", "2")


def card_snippet(export_dir: Path) -> str:
    card = (export_dir / "README.md").read_text()
    return re.search(r"## How to load\n\n```python\n(.*?)\n```", card, re.DOTALL).group(1)


def run_snippet(code: str):
    import torch

    torch.manual_seed(0)  # the pipeline's own latents: the same start for both runs of the card
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    return np.asarray(scope["sample"], dtype=np.float32)


@pytest.mark.parametrize("lora", [False, True], ids=["pipeline", "lora"])
def test_the_cards_how_to_load_samples_a_prompt_from_the_export_as_written(tmp_path, tiny_checkpoint, lora):
    base = tiny_checkpoint("sd3")
    run_dir, _ = make_run(tmp_path / "run", base, "sd3", lora=lora, extra=SMALL)
    out = tmp_path / "export"
    assert export(run_dir, "--out", out, *([] if lora else ["--pipeline"])) == 0
    code = card_snippet(out)
    sample = run_snippet(code)
    assert sample.shape == (32, 32, 3)
    base_transformer = ("from_pretrained(export, transformer=diffusers.SD3Transformer2DModel.from_pretrained("
                        "base, subfolder='transformer'))")
    untrained = run_snippet(code.replace("pipe.load_lora_weights(", "(lambda *a, **k: None)(")
                            if lora else code.replace("from_pretrained(export)", base_transformer))
    assert np.abs(sample - untrained).max() > 0  # the export's weights are what it sampled


def test_a_one_clip_pipeline_export_loads_with_no_arguments_and_encodes_as_training_did(tmp_path, tiny_checkpoint):
    import diffusers
    import torch

    from miles.models.families.sd3 import SD3

    base = tiny_checkpoint("sd3")
    run_dir, _ = make_run(tmp_path / "run", base, "sd3", lora=False, extra=SMALL)
    out = tmp_path / "export"
    assert export(run_dir, "--out", out, "--pipeline") == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["text_encoder_3"][1] == "T5EncoderModel"
    assert "text_encoder_2" not in json.loads((base / "model_index.json").read_text())  # the base is untouched
    for cls in (diffusers.StableDiffusion3Pipeline, diffusers.DiffusionPipeline):
        pipe = cls.from_pretrained(out)
        assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    # the stand-ins add nothing: the pipeline's own encode_prompt gives our engine's conditioning, bit for bit
    embeds, _, pooled, _ = pipe.encode_prompt("a red circle", None, None, do_classifier_free_guidance=False)
    with torch.no_grad():
        ours = SD3().encode({"text_encoder": pipe.text_encoder, "tokenizer": pipe.tokenizer,
                             "transformer": pipe.transformer}, ["a red circle"], SD3.max_sequence_length)
    assert torch.equal(ours["encoder_hidden_states"], embeds) and torch.equal(ours["pooled_projections"], pooled)
    # every weights file readable as an ordinary file is: the base's private (0600) files are copied, not linked
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*.safetensors")}
    assert modes and set(modes.values()) == {0o644 & ~_umask()}, modes


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
