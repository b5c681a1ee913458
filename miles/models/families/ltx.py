"""LTX-Video: LTXVideoTransformer3DModel over the LTX video VAE, T5 text encoder. Unguided.

The transformer takes latent tokens (patch size 1) with the latent grid passed alongside for its
rotary embedding; latents stay [C, f, h, w] everywhere else. As LTXPipeline: the T5 runs without
a mask and its padding positions are kept (the transformer masks them), and sigmas are
`linspace(1, 1/N, N)` shifted with mu from the latent f * h * w.
"""

from __future__ import annotations

from miles.models.families.base import (
    ComponentSpec, FamilyModule, from_unit_range, posterior_mean, t5_encoder_config, timesteps, to_unit_range,
    tokenize,
)

FRAME_RATE = 25  # what LTXPipeline assumes by default; enters the temporal rope scale


class LTX(FamilyModule):
    name = "ltx"
    pipeline_class = "LTXPipeline"
    max_sequence_length = 128
    cfg_in_one_call = True  # the pipeline runs cat([negative, prompt]) and chunks the output
    linspace_sigmas = True

    def components(self, size):
        if size == "tiny":
            z, text_width, max_len = 8, 32, 16
            transformer = dict(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, num_layers=2)
            blocks, layers = (8, 8, 8, 8), (1, 1, 1, 1, 1)
            scaling = (True, True, False, False)
        elif size == "proxy":
            z, text_width, max_len = 128, 1024, 128
            transformer = dict(num_attention_heads=24, attention_head_dim=64, cross_attention_dim=1536, num_layers=20)
            blocks, layers = (128, 256, 512, 512), (4, 3, 3, 3, 4)
            scaling = (True, True, True, False)
        else:
            raise ValueError(f"unknown size {size!r}")
        transformer.update(in_channels=z, out_channels=z, caption_channels=text_width)
        vae = dict(latent_channels=z, block_out_channels=blocks, decoder_block_out_channels=blocks,
                   layers_per_block=layers, decoder_layers_per_block=layers, spatio_temporal_scaling=scaling,
                   decoder_spatio_temporal_scaling=scaling, patch_size=4, patch_size_t=1)
        return {
            "transformer": ComponentSpec("diffusers", "LTXVideoTransformer3DModel", transformer),
            "text_encoder": ComponentSpec("transformers", "T5EncoderModel", t5_encoder_config(size, text_width),
                                          config_class="T5Config"),
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "vae": ComponentSpec("diffusers", "AutoencoderKLLTXVideo", vae),
        }

    def scheduler_config(self):
        # Lightricks/LTX-Video's scheduler_config.json
        return {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.95,
                "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1}

    def encode(self, parts, prompts, max_sequence_length):
        text_encoder = parts["text_encoder"]
        ids, mask = tokenize(parts["tokenizer"], prompts, max_sequence_length, text_encoder.device)
        return {"encoder_hidden_states": text_encoder(ids)[0], "encoder_attention_mask": mask}

    def shift_seq_len(self, parts, latent_shape):
        _, f, h, w = latent_shape
        return f * h * w

    def forward(self, parts, transformer, x, sigma, cond):
        b, c, f, h, w = x.shape
        tokens = x.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)
        temporal, spatial = parts["vae"].temporal_compression_ratio, parts["vae"].spatial_compression_ratio
        out = transformer(hidden_states=tokens, timestep=timesteps(sigma, x), num_frames=f, height=h, width=w,
                          rope_interpolation_scale=(temporal / FRAME_RATE, spatial, spatial), return_dict=False, **cond)[0]
        return out.reshape(b, f, h, w, -1).permute(0, 4, 1, 2, 3)

    def latent_shape(self, parts, height, width, frames):
        vae = parts["vae"]
        temporal, spatial = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        return (vae.config.latent_channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)

    def decode(self, parts, latents):
        vae = parts["vae"]
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents)
        z = (latents * std / vae.config.scaling_factor + mean).to(vae.dtype)
        return to_unit_range(vae.decode(z, return_dict=False)[0]).permute(0, 2, 1, 3, 4)

    def encode_images(self, parts, pixels):
        vae = parts["vae"]
        z = posterior_mean(vae.encode(from_unit_range(pixels, vae).permute(0, 2, 1, 3, 4), return_dict=True)).float()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(z)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(z)
        return (z - mean) * vae.config.scaling_factor / std
