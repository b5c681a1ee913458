"""What every family module provides: how to build its components, and how to call them.

A family module describes its checkpoint (the components and their configs per size, so
`create_checkpoint` can build them) and the three calls that differ between diffusers models:
prompts -> conditioning tensors, one transformer forward, latents -> pixels. Everything else
(guidance, batching) lives in `miles.models.loader`, the schedule in
`miles.diffusion_facts.schedule`. Where a family's pipeline differs (how it builds sigmas, pads prompts or
combines guided outputs) the family says so here, in the pipeline's own terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from miles.models.tokenizer import EOS_ID, PAD_ID, vocabulary
from miles.diffusion_facts.families import FamilyFacts, get_family_facts


@dataclass(frozen=True)
class ComponentSpec:
    """One folder of a checkpoint: `library.class_name` built from `config`.

    For transformers models `config_class` names the config class the dict is passed to; for a
    tokenizer, class_name is PreTrainedTokenizerFast and config holds `model_max_length`.
    """

    library: str  # "diffusers" or "transformers"
    class_name: str
    config: dict[str, Any] = field(default_factory=dict)
    config_class: str | None = None


class FamilyModule:
    name: str = ""
    pipeline_class: str = ""  # the diffusers pipeline class that model_index.json names
    other_pipeline_classes: tuple[str, ...] = ()  # released checkpoints that name another one
    max_sequence_length: int = 77  # the pipeline's default `max_sequence_length` for prompt tokens
    linspace_sigmas: bool = False  # the pipeline passes sigmas=linspace(1, 1/N, N) to set_timesteps
    # guidance as the pipeline runs it: one transformer call on [negative; prompt] (SD3, LTX), or a
    # call for the prompt then one for the negative prompt (Wan, Qwen-Image, Cosmos2)
    cfg_in_one_call: bool = False

    @property
    def facts(self) -> FamilyFacts:
        return get_family_facts(self.name)

    def components(self, size: str) -> dict[str, ComponentSpec]:
        raise NotImplementedError

    def scheduler_config(self) -> dict[str, Any]:
        """The FlowMatchEulerDiscreteScheduler config our checkpoints ship (released-style)."""
        return {"num_train_timesteps": 1000, "shift": self.facts.default_shift}

    def encode(self, parts: dict[str, Any], prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
        """Conditioning tensors for the transformer, batch-first, as the pipeline builds them."""
        raise NotImplementedError

    def shift_seq_len(self, parts: dict[str, Any], latent_shape: tuple[int, ...]) -> int:
        """The latent sequence length the pipeline computes dynamic shifting's mu from."""
        raise ValueError(f"{self.pipeline_class} computes no mu: its scheduler cannot use dynamic shifting")

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """The pipeline's classifier-free guidance of two fp32 outputs (applied only when scale > 1)."""
        return uncond + scale * (cond - uncond)

    def forward(self, parts: dict[str, Any], transformer, x: torch.Tensor, sigma: torch.Tensor,
                cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The raw transformer output (the velocity) for latents x at noise level sigma ([B]).

        `parts` are all components (e.g. LTX's rotary scale depends on the VAE's compression)."""
        raise NotImplementedError

    def latent_shape(self, parts: dict[str, Any], height: int, width: int, frames: int) -> tuple[int, ...]:
        raise NotImplementedError

    def decode(self, parts: dict[str, Any], latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, ...] -> images [B, 3, H, W] (or videos [B, F, 3, H, W]) in [0, 1]."""
        raise NotImplementedError

    def encode_images(self, parts: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """The inverse of `decode`: images [B, 3, H, W] (videos [B, F, 3, H, W]) in [0, 1] -> latents
        [B, ...] in the transformer's layout, normalised as `decode` expects. The VAE posterior's mean
        is used (no sampling), so the same pixels always give the same latents."""
        raise NotImplementedError


def t5_encoder_config(size: str, width: int) -> dict[str, Any]:
    """Our tiny or proxy T5 text encoder of `width` (the T5 and UMT5 classes read the same keys),
    over our tokenizer's vocabulary."""
    if size == "tiny":
        config = dict(d_model=width, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
    else:
        config = dict(d_model=width, d_kv=64, d_ff=2816, num_layers=12, num_heads=16, relative_attention_num_buckets=32)
    config.update(vocab_size=len(vocabulary()), feed_forward_proj="gated-gelu", pad_token_id=PAD_ID,
                  eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID)
    return config


def tokenize(tokenizer, prompts: list[str], max_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and mask padded to `max_length`, so every prompt's tensors have one shape."""
    enc = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def encode_with_mask(parts, prompts, max_length, encoder="text_encoder", tokenizer="tokenizer"):
    """Last hidden state of the masked encoder with padding positions zeroed (the Wan and Cosmos
    pipelines' `_get_t5_prompt_embeds`), and the mask."""
    text_encoder = parts[encoder]
    ids, mask = tokenize(parts[tokenizer], prompts, max_length, text_encoder.device)
    hidden = text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype), mask


def to_unit_range(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels.float() / 2 + 0.5).clamp(0, 1)


def from_unit_range(pixels: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """[0, 1] pixels -> the VAE's [-1, 1] input (in `like`'s dtype when given)."""
    out = pixels.float().clamp(0, 1) * 2 - 1
    return out if like is None else out.to(like.dtype)


def posterior_mean(encoded) -> torch.Tensor:
    """The mean of a diffusers VAE's `encode` output (AutoencoderKLOutput or a tuple of it)."""
    dist = encoded.latent_dist if hasattr(encoded, "latent_dist") else encoded[0]
    return dist.mean


def timesteps(sigma: torch.Tensor, x: torch.Tensor, scale: float = 1000.0) -> torch.Tensor:
    return (sigma * scale).to(device=x.device, dtype=x.dtype)
