"""LTX-2 (LTX-2.3): LTX2VideoTransformer3DModel, an audio-video transformer, over the LTX-2 video
VAE and audio VAE, conditioned by Gemma 3 through LTX2TextConnectors. Unguided in this project.

As LTX2Pipeline: the prompt is stripped, tokenized left-padded to `max_sequence_length`, every
layer's hidden state of the text encoder (embeddings included) is stacked and flattened per token,
and the connectors turn that into the video and audio streams' text embeddings and one mask. The
timestep and the 2.3 prompt-modulation `sigma` are both `sigma * 1000`, the cross-modality
modulation uses the other stream's sigma (`use_cross_timestep`, the 2.3 default), the rope runs at
the pipeline's 24 fps, sigmas are `linspace(1, 1/N, N)` shifted with mu from the VIDEO token count
only, and the pipeline turns each velocity into x0 and back (`convert_velocity_to_x0` /
`convert_x0_to_velocity`) before its Euler step; `forward` does the same round trip.

The joint state. The transformer denoises two token streams of one width (128 released, both
streams): video tokens on the latent grid [f, h, w] (patch size 1) and `na` audio tokens, `na`
fixed by the clip's duration (LTX2Pipeline: round(num_frames / 24 * sample_rate / hop / 4)).
The sampler's state is ONE tensor [f, h, w + r, C]: columns :w hold the video tokens in the
pipeline's packing order, columns w: hold the audio tokens in order, flattened over (f, h, r),
r = ceil(na / (f * h)), and the `f * h * r - na` slots after them are padding whose velocity is 0.
The grid stays in the shape, so `forward` and `decode` recover (f, h, w, na) from the latents
alone, as every other family does (the trainer's recompute and the memory replay see only them).
The flow/SDE step and log-probs (elementwise means) cover the joint state; the padding slots
follow the same law under every policy (velocity 0), so they cancel in a ratio of two policies'
log-probs but dilute its mean by `padding / (f * h * (w + r))` (LTX-2.3 at 768x512, 121 frames:
130 of 6400 slots; at 25 frames 38 of 1600).

`num_frames` must be `(f - 1) * temporal_compression + 1` (the pipeline's rule for whole latent
frames), so that the audio length follows from f. The video VAE decodes the frames; audio is not
decoded (the rewards read frames), so no vocoder is part of our checkpoints.
"""

from __future__ import annotations

import math

import torch

from miles.models.families.base import ComponentSpec, FamilyModule, to_unit_range, timesteps, tokenize
from miles.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, vocabulary

FRAME_RATE = 24.0  # LTX2Pipeline's default frame_rate (motion_speed 1): the rope's fps and the audio length


class LTX2(FamilyModule):
    name = "ltx2"
    pipeline_class = "LTX2Pipeline"
    max_sequence_length = 1024
    cfg_in_one_call = True  # the pipeline runs cat([negative, prompt]) and chunks both outputs
    linspace_sigmas = True

    def components(self, size):
        if size == "tiny":
            z, text, text_layers = 8, 32, 2
            gemma = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
            video_heads, audio_heads, head_dim, audio_head_dim, layers = 2, 2, 16, 8, 2
            connector = dict(heads=(2, 2), dims=(16, 8), layers=1, registers=8)
            # the LTX-2.3 video VAE's block structure less one spatiotemporal block: 16x spatial, 4x temporal
            # (32 px x 5 frames -> a 2 x 2 x 2 grid)
            vae = dict(block_out_channels=(8, 16, 32), decoder_block_out_channels=(8, 8, 16),
                       layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                       spatio_temporal_scaling=(True,) * 3, decoder_spatio_temporal_scaling=(True,) * 3,
                       decoder_inject_noise=(False,) * 4, down_block_types=("LTX2VideoDownBlock3D",) * 3,
                       downsample_type=("spatial", "temporal", "spatiotemporal"),
                       upsample_type=("spatiotemporal", "temporal", "spatial"), upsample_residual=(False,) * 3,
                       upsample_factor=(2, 1, 2), spatial_compression_ratio=16, temporal_compression_ratio=4)
            audio = dict(base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=2, mel_bins=16)
            max_len = 16
        elif size == "proxy":
            z, text, text_layers = 128, 1024, 12
            gemma = dict(intermediate_size=4096, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
            video_heads, audio_heads, head_dim, audio_head_dim, layers = 16, 8, 64, 64, 12
            connector = dict(heads=(16, 8), dims=(64, 64), layers=2, registers=128)
            # the LTX-2.3 video VAE's block structure (32x spatial, 8x temporal), narrower
            vae = dict(block_out_channels=(128, 256, 512, 512), decoder_block_out_channels=(128, 256, 256, 512),
                       layers_per_block=(2, 3, 2, 1, 1), decoder_layers_per_block=(2, 3, 2, 1, 1),
                       spatio_temporal_scaling=(True,) * 4, decoder_spatio_temporal_scaling=(True,) * 4,
                       decoder_inject_noise=(False,) * 5, down_block_types=("LTX2VideoDownBlock3D",) * 4,
                       downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                       upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
                       upsample_residual=(False,) * 4, upsample_factor=(2, 2, 1, 2), spatial_compression_ratio=32,
                       temporal_compression_ratio=8)
            # the LTX-2.3 audio VAE as released (8 x 16 latent: 128-wide tokens)
            audio = dict(base_channels=128, ch_mult=(1, 2, 4), num_res_blocks=2, latent_channels=8, mel_bins=64)
            max_len = 1024
        else:
            raise ValueError(f"unknown size {size!r}")
        vae.update(latent_channels=z, patch_size=4, patch_size_t=1, timestep_conditioning=False,
                   decoder_causal=False, encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="zeros")
        audio.update(output_channels=2, in_channels=2, attn_resolutions=None, norm_type="pixel",
                     causality_axis="height", mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
                     is_causal=True, double_z=True)
        audio_tokens_width = audio["latent_channels"] * audio["mel_bins"] // 4  # the audio VAE compresses mel 4x
        if audio_tokens_width != z or audio["base_channels"] != z:
            raise AssertionError("the joint state needs video and audio tokens of one width")
        video_dim, audio_dim = video_heads * head_dim, audio_heads * audio_head_dim
        # the LTX-2.3 switches (scripts/convert_ltx2_to_diffusers.py, version 2.3): gated attention,
        # cross-attention modulation, perturbed attention, no caption projection, split rope
        transformer = dict(in_channels=z, out_channels=z, patch_size=1, patch_size_t=1,
                           num_attention_heads=video_heads, attention_head_dim=head_dim, cross_attention_dim=video_dim,
                           vae_scale_factors=(vae["temporal_compression_ratio"], vae["spatial_compression_ratio"],
                                              vae["spatial_compression_ratio"]),
                           gated_attn=True, cross_attn_mod=True, audio_in_channels=z, audio_out_channels=z,
                           audio_num_attention_heads=audio_heads, audio_attention_head_dim=audio_head_dim,
                           audio_cross_attention_dim=audio_dim, audio_gated_attn=True, audio_cross_attn_mod=True,
                           num_layers=layers, caption_channels=text, rope_type="split", use_prompt_embeddings=False,
                           perturbed_attn=True)
        connectors = dict(caption_channels=text, text_proj_in_factor=text_layers + 1,
                          video_connector_num_attention_heads=connector["heads"][0],
                          video_connector_attention_head_dim=connector["dims"][0],
                          video_connector_num_layers=connector["layers"],
                          video_connector_num_learnable_registers=connector["registers"], video_gated_attn=True,
                          audio_connector_num_attention_heads=connector["heads"][1],
                          audio_connector_attention_head_dim=connector["dims"][1],
                          audio_connector_num_layers=connector["layers"],
                          audio_connector_num_learnable_registers=connector["registers"], audio_gated_attn=True,
                          rope_type="split", per_modality_projections=True, video_hidden_dim=video_dim,
                          audio_hidden_dim=audio_dim, proj_bias=True)
        gemma.update(hidden_size=text, num_hidden_layers=text_layers, vocab_size=len(vocabulary()),
                     max_position_embeddings=2 * self.max_sequence_length, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                     eos_token_id=EOS_ID)
        return {
            "transformer": ComponentSpec("diffusers", "LTX2VideoTransformer3DModel", transformer),
            # Gemma 3's text model: all LTX2Pipeline reads of its Gemma3ForConditionalGeneration is
            # the hidden states of every layer for text input
            "text_encoder": ComponentSpec("transformers", "Gemma3TextModel", gemma, config_class="Gemma3TextConfig"),
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "connectors": ComponentSpec("ltx2", "LTX2TextConnectors", connectors),
            "vae": ComponentSpec("diffusers", "AutoencoderKLLTX2Video", vae),
            "audio_vae": ComponentSpec("diffusers", "AutoencoderKLLTX2Audio", audio),
        }

    def scheduler_config(self):
        # the non-distilled LTX-2 scheduler (scripts/convert_ltx2_to_diffusers.py)
        return {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.95,
                "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1}

    # -- prompts --

    def encode(self, parts, prompts, max_sequence_length):
        text_encoder, tokenizer = parts["text_encoder"], parts["tokenizer"]
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"  # as the pipeline sets it for Gemma
        try:
            ids, mask = tokenize(tokenizer, [p.strip() for p in prompts], max_sequence_length, text_encoder.device)
        finally:
            tokenizer.padding_side = side
        hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(text_encoder.dtype)
        video, audio, connector_mask = parts["connectors"](embeds, mask, padding_side="left")
        return {"encoder_hidden_states": video, "audio_encoder_hidden_states": audio,
                "encoder_attention_mask": connector_mask}

    # -- the joint state --

    def audio_tokens(self, parts, latent_frames: int) -> int:
        """The pipeline's audio latent length for a clip of `latent_frames` latent frames."""
        vae, audio = parts["vae"], parts["audio_vae"]
        frames = (latent_frames - 1) * vae.temporal_compression_ratio + 1
        per_second = audio.config.sample_rate / audio.config.mel_hop_length / float(audio.temporal_compression_ratio)
        return round(frames / FRAME_RATE * per_second)

    def geometry(self, parts, shape) -> tuple[int, int, int, int, int]:
        """(f, h, w, r, na) of a joint state of shape [f, h, w + r, C]."""
        f, h, columns = shape[-4], shape[-3], shape[-2]
        na = self.audio_tokens(parts, f)
        r = math.ceil(na / (f * h))
        return f, h, columns - r, r, na

    def split(self, parts, x):
        """Joint state [B, f, h, w + r, C] -> packed video [B, f*h*w, C], packed audio [B, na, C]."""
        b, c = x.shape[0], x.shape[-1]
        f, h, w, r, na = self.geometry(parts, x.shape)
        video = x[:, :, :, :w].reshape(b, f * h * w, c)
        audio = x[:, :, :, w:].reshape(b, f * h * r, c)[:, :na]
        return video, audio

    def join(self, parts, video, audio, shape):
        """The inverse of `split`; padding slots are 0."""
        b, c = video.shape[0], video.shape[-1]
        f, h, w, r, na = self.geometry(parts, shape)
        slots = video.new_zeros(b, f * h * r, c)
        slots[:, :na] = audio
        return torch.cat([video.reshape(b, f, h, w, c), slots.reshape(b, f, h, r, c)], dim=3)

    def latent_shape(self, parts, height, width, frames):
        vae = parts["vae"]
        temporal, spatial = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        if (frames - 1) % temporal:
            raise ValueError(f"LTX-2 needs num_frames = k * {temporal} + 1 (whole latent frames), got {frames}")
        f, h, w = (frames - 1) // temporal + 1, height // spatial, width // spatial
        r = math.ceil(self.audio_tokens(parts, f) / (f * h))
        return (f, h, w + r, parts["transformer"].config.in_channels)

    def shift_seq_len(self, parts, latent_shape):
        f, h, w, _, _ = self.geometry(parts, latent_shape)
        return f * h * w  # the pipeline's mu counts the video tokens only

    def forward(self, parts, transformer, x, sigma, cond):
        f, h, w, _, na = self.geometry(parts, x.shape)
        video, audio = self.split(parts, x)
        t = timesteps(sigma, x)
        v_video, v_audio = transformer(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=cond["encoder_hidden_states"],
            audio_encoder_hidden_states=cond["audio_encoder_hidden_states"], timestep=t, sigma=t,
            encoder_attention_mask=cond["encoder_attention_mask"],
            audio_encoder_attention_mask=cond["encoder_attention_mask"], num_frames=f, height=h, width=w,
            fps=FRAME_RATE, audio_num_frames=na, use_cross_timestep=True, return_dict=False)
        v = self.join(parts, v_video.float(), v_audio.float(), x.shape)
        # the pipeline's velocity -> x0 -> velocity round trip in float32, at this step's sigma
        s = sigma.to(device=x.device, dtype=torch.float32).view(-1, 1, 1, 1, 1)
        state = x.float()
        return (state - (state - v * s)) / s

    # -- pixels --

    def decode(self, parts, latents):
        vae = parts["vae"]
        f, h, w, _, _ = self.geometry(parts, latents.shape)
        video = latents[:, :, :, :w].permute(0, 4, 1, 2, 3)  # [B, C, f, h, w]
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(video)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(video)
        z = (video * std / vae.config.scaling_factor + mean).to(vae.dtype)
        return to_unit_range(vae.decode(z, None, return_dict=False)[0]).permute(0, 2, 1, 3, 4)

    def encode_images(self, parts, pixels):
        raise NotImplementedError("ltx2's state holds audio latents too, which frames do not give (no SFT from videos)")
