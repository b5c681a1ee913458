"""Cosmos (Predict2-style text-to-image): CosmosTransformer3DModel over the Wan VAE, T5 encoder.

Images are one-frame videos to the transformer and the VAE; latents stay [C, h, w] otherwise.

Cosmos2TextToImagePipeline samples in EDM coordinates: Karras sigmas s from `sigma_max` (80) to
`sigma_min` (0.002, held for the last step), latents x_edm starting at sigma_max * noise, the
transformer called on x_edm * c_in at time t = s / (s + 1), its output turned into a denoised
estimate c_skip x_edm + c_out out, guidance `cond + g (cond - uncond)` on that estimate, and an EDM
Euler step. With c_in = c_skip = 1 - t and c_out = -t this is exactly a flow-matching sampler in
x = x_edm / (1 + s) = x_edm (1 - t) whose velocity is the transformer output: the estimate is
x - t out, and the EDM Euler step from s to s' is the flow Euler step from t to t'. So this family
runs the ordinary flow sampler on those times (`miles.diffusion_facts.schedule.edm_flow_sigmas`), starts
from t_0 * noise, guides with `cond + g (cond - uncond)` (the pipeline's formula, g > 1 only) and
decodes x / (1 - t_final) as the pipeline decodes x_edm; the SDE branch keeps Flow-GRPO's math in
these coordinates. tests/unit/models/test_pipeline_parity.py compares it with the pipeline.
"""

from __future__ import annotations

from miles.models.families.base import ComponentSpec, FamilyModule, encode_with_mask, t5_encoder_config
from miles.models.families.wan2_2 import wan_decode, wan_encode, wan_latent_shape, wan_vae


class Cosmos3(FamilyModule):
    name = "cosmos3"
    pipeline_class = "Cosmos2TextToImagePipeline"
    other_pipeline_classes = ("CosmosTextToWorldPipeline", "Cosmos2VideoToWorldPipeline")
    max_sequence_length = 512

    def components(self, size):
        if size == "tiny":
            z, text_width, max_len = 4, 32, 16
            transformer = dict(num_attention_heads=2, attention_head_dim=16, num_layers=2, mlp_ratio=2.0,
                               adaln_lora_dim=8, max_size=(4, 32, 32), rope_scale=(1.0, 1.0, 1.0))
        elif size == "proxy":
            z, text_width, max_len = 16, 1024, 512
            transformer = dict(num_attention_heads=16, attention_head_dim=128, num_layers=20, mlp_ratio=4.0,
                               adaln_lora_dim=256, max_size=(128, 240, 240), rope_scale=(1.0, 4.0, 4.0))
        else:
            raise ValueError(f"unknown size {size!r}")
        transformer.update(in_channels=z, out_channels=z, text_embed_dim=text_width, patch_size=(1, 2, 2),
                           concat_padding_mask=False, extra_pos_embed_type=None)
        return {
            "transformer": ComponentSpec("diffusers", "CosmosTransformer3DModel", transformer),
            "text_encoder": ComponentSpec("transformers", "T5EncoderModel", t5_encoder_config(size, text_width),
                                          config_class="T5Config"),
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "vae": wan_vae(size, z),
        }

    def scheduler_config(self):
        # Cosmos-Predict2's scheduler_config.json: FlowMatchEuler carrying EDM's Karras sigmas
        return {"num_train_timesteps": 1000, "shift": 1.0, "use_karras_sigmas": True, "sigma_min": 0.002,
                "sigma_max": 80.0, "sigma_data": 1.0, "final_sigmas_type": "sigma_min"}

    def guide(self, cond, uncond, scale):
        # the pipeline's `noise_pred + g (noise_pred - noise_pred_uncond)` on the denoised estimates,
        # which is the same formula on velocities (the estimate is affine in the output)
        return cond + scale * (cond - uncond)

    def encode(self, parts, prompts, max_sequence_length):
        hidden, _ = encode_with_mask(parts, prompts, max_sequence_length)
        return {"encoder_hidden_states": hidden}

    def forward(self, parts, transformer, x, sigma, cond):
        video = x.unsqueeze(2)
        extra = {}
        if transformer.config.concat_padding_mask:  # released checkpoints: nothing is padding
            extra["padding_mask"] = x.new_zeros(1, 1, x.shape[-2], x.shape[-1])
        out = transformer(hidden_states=video, timestep=sigma.to(x.dtype), return_dict=False, **cond, **extra)[0]
        return out[:, :, 0]

    def latent_shape(self, parts, height, width, frames):
        z, _, h, w = wan_latent_shape(parts["vae"], height, width, 1)
        return (z, h, w)

    def decode(self, parts, latents):
        return wan_decode(parts["vae"], latents.unsqueeze(2))[:, 0]

    def encode_images(self, parts, pixels):
        return wan_encode(parts["vae"], pixels.unsqueeze(1))[:, :, 0]
