"""The model card's "How to load": code that loads the export and samples one prompt, as written.

It samples with the run's own settings (size, steps, guidance). A --pipeline export is complete
(stand_ins.py gives a one-CLIP SD3 the encoders its pipeline requires): `pipe(prompt)`. A LoRA or
transformer export of such a base loads the base with the missing encoders passed as None, and,
since StableDiffusion3Pipeline's encode_prompt always runs two CLIPs, embeds the prompt as
training did and passes the embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPT = "a red circle on a blue background"


def pipeline_components(pipeline_class: str) -> list[str]:
    """The components the diffusers pipeline's constructor takes."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    return sorted(cls._get_signature_keys(cls)[0])


def absent_components(pipeline_class: str, base: Path) -> list[str]:
    present = json.loads((base / "model_index.json").read_text())
    return [c for c in pipeline_components(pipeline_class) if c not in present]


def how_to_load(source, components: list[str], out: str, pipeline: bool) -> str:
    from miles.models.registry import get_family

    family = get_family(source.family)
    cls = family.pipeline_class
    head = ["import diffusers", "import torch", f"base = {str(source.base)!r}", f"export = {str(out)!r}"]
    if pipeline:
        return "\n".join(head + [f"pipe = diffusers.{cls}.from_pretrained(export)"] + _sample(source, family, True))
    nones = "".join(f", {c}=None" for c in absent_components(cls, source.base))
    lines = head + [f"pipe = diffusers.{cls}.from_pretrained(base{nones})"]
    if source.lora is not None:
        lines += [_load_lora(cls, c) for c in components]
    else:
        lines += [f"pipe.{c} = type(pipe.{c}).from_pretrained(export, subfolder={c!r})" for c in components]
    return "\n".join(lines + _sample(source, family, False))


def _load_lora(pipeline_class: str, component: str) -> str:
    import diffusers

    from miles.export.lora import weight_name

    name = weight_name(component)
    if hasattr(getattr(diffusers, pipeline_class), "load_lora_weights"):
        target = "" if component == "transformer" else ", load_into_transformer_2=True"
        return f"pipe.load_lora_weights(export, weight_name={name!r}{target})"
    # Cosmos2's pipeline has no LoRA loader; its transformer loads the same file
    return f"pipe.{component}.load_lora_adapter(export, weight_name={name!r}, prefix='transformer')"


def _sample(source, family, pipeline: bool) -> list[str]:
    from miles.export.stand_ins import needs_stand_ins

    a = source.train_args
    settings = (f"height={a.diffusion_height}, width={a.diffusion_width}, "
                f"num_inference_steps={a.diffusion_num_steps}, guidance_scale={a.diffusion_guidance_scale}")
    if not pipeline and needs_stand_ins(source.family, source.base):
        return _sd3_one_clip(settings, a.diffusion_max_sequence_length or family.module.max_sequence_length)
    return ["# the first image (a video: its frames)", f"sample = pipe({PROMPT!r},", f"              {settings})[0][0]"]


def _sd3_one_clip(settings: str, t5_tokens: int) -> list[str]:
    return [
        "# one CLIP, no T5: StableDiffusion3Pipeline's encode_prompt needs two CLIPs, so embed as training did:",
        "# the CLIP's penultimate hidden states padded to the joint width, then the T5 slot's zeros",
        "def embed(text):",
        "    ids = pipe.tokenizer([text], padding='max_length', max_length=pipe.tokenizer.model_max_length,",
        "                         truncation=True, return_tensors='pt').input_ids",
        "    with torch.no_grad():",
        "        out = pipe.text_encoder(ids, output_hidden_states=True)",
        "    joint = pipe.transformer.config.joint_attention_dim",
        "    hidden = torch.nn.functional.pad(out.hidden_states[-2], (0, joint - out.hidden_states[-2].shape[-1]))",
        f"    return torch.cat([hidden, hidden.new_zeros(1, {t5_tokens}, joint)], dim=1), out.text_embeds",
        "",
        f"prompt, pooled = embed({PROMPT!r})",
        "negative, negative_pooled = embed('')",
        "sample = pipe(prompt_embeds=prompt, pooled_prompt_embeds=pooled, negative_prompt_embeds=negative,",
        f"              negative_pooled_prompt_embeds=negative_pooled, {settings}).images[0]",
    ]
