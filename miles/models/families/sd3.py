"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel (MMDiT) over AutoencoderKL latents.

Conditioning as StableDiffusion3Pipeline builds it: the CLIP encoders' penultimate hidden states
side by side (each tokenizer padded to its own model_max_length), zero-padded to the joint width,
followed by the T5 slot: the T5 sequence, or `max_sequence_length` zero tokens when there is no
T5 (the pipeline appends them and the joint attention sees them). The pooled projection is the
CLIP text embeddings side by side. Our checkpoints have one CLIP and no T5. Sigmas: the scheduler's
`set_timesteps(N)`, mu from (h / patch) * (w / patch) when it shifts dynamically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.models.families.base import (
    ComponentSpec, FamilyModule, from_unit_range, posterior_mean, timesteps, to_unit_range, tokenize,
)
from miles.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, vocabulary

_CLIPS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))


def _clip(hidden: int, layers: int, heads: int, projection: int, max_len: int) -> ComponentSpec:
    return ComponentSpec("transformers", "CLIPTextModelWithProjection", dict(
        vocab_size=len(vocabulary()), hidden_size=hidden, intermediate_size=hidden * 4,
        num_hidden_layers=layers, num_attention_heads=heads, projection_dim=projection,
        max_position_embeddings=max_len, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    ), config_class="CLIPTextConfig")


def _vae(channels: tuple[int, ...], latent_channels: int, groups: int) -> ComponentSpec:
    return ComponentSpec("diffusers", "AutoencoderKL", dict(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=["DownEncoderBlock2D"] * len(channels), up_block_types=["UpDecoderBlock2D"] * len(channels),
        block_out_channels=list(channels), layers_per_block=1, norm_num_groups=groups,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    ))


class SD3(FamilyModule):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    max_sequence_length = 256
    cfg_in_one_call = True  # the pipeline runs cat([negative, prompt]) and chunks the output

    def components(self, size):
        if size == "tiny":
            width, max_len = 32, 16
            transformer = dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                               attention_head_dim=8, num_attention_heads=4, joint_attention_dim=width,
                               caption_projection_dim=32, pooled_projection_dim=width, pos_embed_max_size=32)
            clip, vae = _clip(width, 2, 4, width, max_len), _vae((8, 16, 16, 16), 4, 4)
        elif size == "proxy":
            width, max_len = 768, 77
            transformer = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                               attention_head_dim=64, num_attention_heads=24, joint_attention_dim=width,
                               caption_projection_dim=1536, pooled_projection_dim=width, pos_embed_max_size=192,
                               qk_norm="rms_norm")
            clip, vae = _clip(width, 12, 12, width, max_len), _vae((128, 256, 512, 512), 16, 32)
        else:
            raise ValueError(f"unknown size {size!r}")
        return {
            "transformer": ComponentSpec("diffusers", "SD3Transformer2DModel", transformer),
            "text_encoder": clip,
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "vae": vae,
        }

    def encode(self, parts, prompts, max_sequence_length):
        hidden, pooled = [], []
        for enc_name, tok_name in _CLIPS:
            if parts.get(enc_name) is None:
                continue
            enc, tokenizer = parts[enc_name], parts[tok_name]
            ids, _ = tokenize(tokenizer, prompts, tokenizer.model_max_length, enc.device)
            out = enc(input_ids=ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        clip_hidden = torch.cat(hidden, dim=-1)
        t5 = self._t5_slot(parts, prompts, max_sequence_length, clip_hidden)
        sequence = torch.cat([F.pad(clip_hidden, (0, t5.shape[-1] - clip_hidden.shape[-1])), t5], dim=-2)
        return {"encoder_hidden_states": sequence, "pooled_projections": torch.cat(pooled, dim=-1)}

    @staticmethod
    def _t5_slot(parts, prompts, max_sequence_length, like):
        t5 = parts.get("text_encoder_3")
        if t5 is None:
            joint = parts["transformer"].config.joint_attention_dim
            return like.new_zeros(len(prompts), max_sequence_length, joint)
        ids, _ = tokenize(parts["tokenizer_3"], prompts, max_sequence_length, t5.device)
        return t5(input_ids=ids).last_hidden_state.to(like.dtype)

    def shift_seq_len(self, parts, latent_shape):
        patch = parts["transformer"].config.patch_size
        return (latent_shape[-2] // patch) * (latent_shape[-1] // patch)

    def forward(self, parts, transformer, x, sigma, cond):
        return transformer(hidden_states=x, timestep=timesteps(sigma, x), return_dict=False, **cond)[0]

    def latent_shape(self, parts, height, width, frames):
        vae = parts["vae"]
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
        return (parts["transformer"].config.in_channels, height // factor, width // factor)

    def decode(self, parts, latents):
        vae = parts["vae"]
        z = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return to_unit_range(vae.decode(z, return_dict=False)[0])

    def encode_images(self, parts, pixels):
        vae = parts["vae"]
        z = posterior_mean(vae.encode(from_unit_range(pixels, vae), return_dict=True)).float()
        return (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
