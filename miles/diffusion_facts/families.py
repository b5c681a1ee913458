"""Torch-free facts about each model family.

The validator needs these (which family a checkpoint is, where Wan2.2 switches experts) without
importing torch; `miles.models.registry` adds the diffusers classes on top of them.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILY_NAMES = ("sd3", "qwen_image", "wan2_2", "ltx", "cosmos3", "ltx2")

_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    name_patterns: tuple[str, ...]  # lower-case substrings of a checkpoint path that select it
    is_video: bool
    guided: bool  # trains with classifier-free guidance
    transformer_components: tuple[str, ...]
    default_shift: float  # sigma shift of the flow-matching schedule
    default_sde_type: str
    lora_target_modules: tuple[str, ...]
    boundary_ratio: float | None = None  # Wan2.2: `transformer` owns t >= ratio * num_train_timesteps
    # Cosmos2: EDM (Karras) sigmas whose last step holds at sigma_min, so it has no length (and no
    # SDE noise to train on); the shift does not change them
    edm_sigmas: bool = False
    transformer_class: str = ""  # the diffusers class each transformer component must be
    # components a checkpoint needs besides the transformer(s), text_encoder, tokenizer, vae and
    # scheduler (LTX-2: its text connectors and audio VAE)
    extra_components: tuple[str, ...] = ()
    # whether SFT media (images, videos) encode into the sampler's state (`FamilyModule.encode_images`);
    # LTX-2's state holds audio latents too, which frames do not give
    encodes_media: bool = True
    # parts the pipeline runs in float32 whatever the compute and rollout dtypes (engine, trainer,
    # plan and replay alike): Wan's VAE, as the Wan team and diffusers' Wan docs run it for its
    # decoding quality
    float32_parts: tuple[str, ...] = ()

    def runs_in_float32(self, part: str) -> bool:
        return part in self.float32_parts

    @property
    def num_experts(self) -> int:
        return len(self.transformer_components)


FAMILIES: dict[str, FamilyFacts] = {
    f.name: f
    for f in (
        FamilyFacts("sd3", ("sd3", "stable-diffusion-3", "stable_diffusion_3"), False, True,
                    ("transformer",), 3.0, "sde", _ATTENTION + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
                    transformer_class="SD3Transformer2DModel"),
        FamilyFacts("qwen_image", ("qwen-image", "qwen_image", "qwenimage"), False, True,
                    ("transformer",), 3.0, "sde", _ATTENTION + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
                    transformer_class="QwenImageTransformer2DModel"),
        FamilyFacts("wan2_2", ("wan2.2", "wan2_2", "wan22", "wan-2.2"), True, True,
                    ("transformer", "transformer_2"), 12.0, "sde", _ATTENTION + ("ffn.net.0.proj", "ffn.net.2"),
                    boundary_ratio=0.875, transformer_class="WanTransformer3DModel", float32_parts=("vae",)),
        # before "ltx", whose pattern also occurs in LTX-2 names (match_family takes the first match)
        FamilyFacts("ltx2", ("ltx-2", "ltx2", "ltx_2"), True, False, ("transformer",), 3.0, "cps", _ATTENTION,
                    transformer_class="LTX2VideoTransformer3DModel", extra_components=("connectors", "audio_vae"),
                    encodes_media=False),
        FamilyFacts("ltx", ("ltx",), True, False, ("transformer",), 3.0, "cps", _ATTENTION,
                    transformer_class="LTXVideoTransformer3DModel"),
        FamilyFacts("cosmos3", ("cosmos3", "cosmos-3", "cosmos"), False, True, ("transformer",), 3.0, "sde", _ATTENTION,
                    edm_sigmas=True, transformer_class="CosmosTransformer3DModel"),
    )
}


class UnknownFamilyError(ValueError):
    pass


def get_family_facts(name: str) -> FamilyFacts:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; choose one of {', '.join(FAMILY_NAMES)}"
        ) from None


def match_family(checkpoint: str) -> str | None:
    """The family whose name pattern occurs in a checkpoint path or name, or None."""
    lowered = checkpoint.lower()
    for facts in FAMILIES.values():
        if any(pattern in lowered for pattern in facts.name_patterns):
            return facts.name
    return None


def recorded_family(checkpoint: str | None) -> str | None:
    """The family our own checkpoints record in model_index.json (`_miles_family`), or None."""
    import json
    from pathlib import Path

    index = Path(checkpoint or "") / "model_index.json"
    try:
        return json.loads(index.read_text()).get("_miles_family") if checkpoint and index.is_file() else None
    except (OSError, ValueError):
        return None


def resolve_family(explicit: str | None, checkpoint: str | None) -> str:
    """`--diffusion-model-family` if given, else matched from the checkpoint's name."""
    if explicit:
        recorded = recorded_family(checkpoint)
        if recorded and recorded != get_family_facts(explicit).name:
            raise UnknownFamilyError(
                f"--diffusion-model-family {explicit}: --hf-checkpoint {checkpoint} is a {recorded} checkpoint "
                f"(its model_index.json says so); fix: drop --diffusion-model-family (or pass {recorded}), or give "
                f"a {explicit} checkpoint")
        return get_family_facts(explicit).name
    matched = match_family(checkpoint or "")
    if matched is None:
        raise UnknownFamilyError(
            f"cannot tell the model family from --hf-checkpoint {checkpoint!r}; "
            f"pass --diffusion-model-family (one of {', '.join(FAMILY_NAMES)})"
        )
    return matched
