"""Wan2.2 (A14B layout): two WanTransformer3DModel experts over the Wan VAE, UMT5 text encoder.

`transformer` denoises the high-noise steps (t >= boundary_ratio * 1000), `transformer_2` the rest;
which one runs is decided in `DiffusionModel.expert_for`, from miles.diffusion_facts.schedule, on the
pipeline's float32 timestep. Guidance as WanPipeline applies it: on only when the high-noise scale
is > 1, then each expert's own scale.

Prompts are cleaned (`prompt_clean`) and padded to `max_sequence_length` zero tokens as the pipeline
does; its cross-attention has no mask, so the padding is part of the conditioning.

Schedule: released Wan2.2 checkpoints ship a UniPC multistep scheduler with `flow_shift`. The
SDE sampler needs a one-step (Euler) update per sigma pair to define each step's Gaussian, so it
runs the FlowMatchEulerDiscreteScheduler of the same config (`shift = flow_shift`,
`set_timesteps(N)`), which is what the pipeline-parity test runs WanPipeline with.
"""

from __future__ import annotations

from miles.models.families.base import (
    ComponentSpec, FamilyModule, encode_with_mask, from_unit_range, posterior_mean, t5_encoder_config, timesteps,
    to_unit_range,
)


def wan_vae(size: str, z: int) -> ComponentSpec:
    if size == "tiny":
        config = dict(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
                      latents_mean=[0.0] * z, latents_std=[1.0] * z)
    else:
        config = dict(base_dim=96, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
    return ComponentSpec("diffusers", "AutoencoderKLWan", config)


def wan_latent_shape(vae, height: int, width: int, frames: int) -> tuple[int, ...]:
    temporal = 2 ** sum(vae.temperal_downsample)
    spatial = 2 ** len(vae.temperal_downsample)
    return (vae.config.z_dim, (frames - 1) // temporal + 1, height // spatial, width // spatial)


def wan_decode(vae, latents):
    """[B, z, f, h, w] -> [B, F, 3, H, W] in [0, 1]."""
    mean = latents.new_tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = latents.new_tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    video = vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]
    return to_unit_range(video).permute(0, 2, 1, 3, 4)


def wan_encode(vae, videos):
    """[B, F, 3, H, W] in [0, 1] -> [B, z, f, h, w], normalised as `wan_decode` undoes."""
    x = from_unit_range(videos, vae).permute(0, 2, 1, 3, 4)
    z = posterior_mean(vae.encode(x, return_dict=True)).float()
    mean = z.new_tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = z.new_tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (z - mean) / std


class Wan22(FamilyModule):
    name = "wan2_2"
    pipeline_class = "WanPipeline"
    max_sequence_length = 512

    def components(self, size):
        if size == "tiny":
            z, text_width, max_len = 4, 32, 16
            transformer = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=z, out_channels=z,
                               text_dim=text_width, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
        elif size == "proxy":
            z, text_width, max_len = 16, 1024, 512
            transformer = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=z, out_channels=z,
                               text_dim=text_width, freq_dim=256, ffn_dim=8960, num_layers=20)
        else:
            raise ValueError(f"unknown size {size!r}")
        return {
            "transformer": ComponentSpec("diffusers", "WanTransformer3DModel", transformer),
            "transformer_2": ComponentSpec("diffusers", "WanTransformer3DModel", transformer),
            "text_encoder": ComponentSpec("transformers", "UMT5EncoderModel", t5_encoder_config(size, text_width),
                                          config_class="UMT5Config"),
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "vae": wan_vae(size, z),
        }

    def encode(self, parts, prompts, max_sequence_length):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        hidden, _ = encode_with_mask(parts, [prompt_clean(p) for p in prompts], max_sequence_length)
        return {"encoder_hidden_states": hidden}

    def forward(self, parts, transformer, x, sigma, cond):
        return transformer(hidden_states=x, timestep=timesteps(sigma, x), return_dict=False, **cond)[0]

    def latent_shape(self, parts, height, width, frames):
        return wan_latent_shape(parts["vae"], height, width, frames)

    def decode(self, parts, latents):
        return wan_decode(parts["vae"], latents)

    def encode_images(self, parts, pixels):
        return wan_encode(parts["vae"], pixels)
