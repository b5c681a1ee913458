"""Qwen-Image: QwenImageTransformer2DModel over the Qwen-Image VAE, conditioned by a Qwen LM.

The transformer takes 2x2-packed latent tokens; latents stay [C, h, w] everywhere else and are
packed around each forward. As QwenImagePipeline: the prompt is wrapped in its chat template, the
text encoder's last hidden state is taken without the template's first 34 tokens, cut to
`max_sequence_length` (here also zero-padded to it, masked, so every prompt's tensors have one
shape); the timestep is the pipeline's float32 `t / 1000`; guidance is true CFG with the guided
output rescaled to the conditional one's norm over each packed token; sigmas are
`linspace(1, 1/N, N)` shifted with mu from the packed sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.models.families.base import (
    ComponentSpec, FamilyModule, from_unit_range, posterior_mean, timesteps, to_unit_range,
)
from miles.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, vocabulary


def pack(x):
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens, channels, h, w):
    b = tokens.shape[0]
    return tokens.view(b, h // 2, w // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, channels, h, w)


class QwenImage(FamilyModule):
    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    max_sequence_length = 512
    linspace_sigmas = True
    prompt_template = (
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
        "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    template_drop = 34  # QwenImagePipeline.prompt_template_encode_start_idx
    tokenizer_max_length = 1024  # QwenImagePipeline.tokenizer_max_length

    def components(self, size):
        if size == "tiny":
            z, text_width, max_len = 4, 32, 16
            transformer = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6))
            text = dict(intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
            vae = dict(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, False, False],
                       latents_mean=[0.0] * z, latents_std=[1.0] * z)
        elif size == "proxy":
            z, text_width, max_len = 16, 1536, 512
            transformer = dict(num_layers=20, attention_head_dim=128, num_attention_heads=16, axes_dims_rope=(16, 56, 56))
            text = dict(intermediate_size=8960, num_hidden_layers=8, num_attention_heads=12, max_position_embeddings=2048)
            vae = dict(base_dim=96, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
        else:
            raise ValueError(f"unknown size {size!r}")
        transformer.update(patch_size=2, in_channels=4 * z, out_channels=z, joint_attention_dim=text_width)
        text.update(hidden_size=text_width, num_key_value_heads=2, vocab_size=len(vocabulary()), pad_token_id=PAD_ID,
                    bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        return {
            "transformer": ComponentSpec("diffusers", "QwenImageTransformer2DModel", transformer),
            "text_encoder": ComponentSpec("transformers", "Qwen2Model", text, config_class="Qwen2Config"),
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "vae": ComponentSpec("diffusers", "AutoencoderKLQwenImage", vae),
        }

    def scheduler_config(self):
        # Qwen/Qwen-Image's scheduler_config.json
        return {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                "time_shift_type": "exponential"}

    def encode(self, parts, prompts, max_sequence_length):
        hidden, mask = [], []
        for prompt in prompts:
            embeds = self._embed(parts, prompt)[:max_sequence_length]
            padding = max_sequence_length - embeds.shape[0]
            hidden.append(F.pad(embeds, (0, 0, 0, padding)))
            mask.append(F.pad(torch.ones(embeds.shape[0], dtype=torch.long, device=embeds.device), (0, padding)))
        return {"encoder_hidden_states": torch.stack(hidden), "encoder_hidden_states_mask": torch.stack(mask)}

    def _embed(self, parts, prompt):
        """One prompt's embeddings, [tokens, width], as `_get_qwen_prompt_embeds` makes them."""
        text_encoder = parts["text_encoder"]
        enc = parts["tokenizer"]([self.prompt_template.format(prompt)], max_length=self.tokenizer_max_length + self.template_drop,
                                 padding=True, truncation=True, return_tensors="pt").to(text_encoder.device)
        out = text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask, output_hidden_states=True)
        return out.hidden_states[-1][0][enc.attention_mask[0].bool()][self.template_drop:]

    def forward(self, parts, transformer, x, sigma, cond):
        _, c, h, w = x.shape
        timestep = timesteps(sigma, x) / 1000  # the pipeline passes t / 1000, t = sigma * 1000 in float32
        out = transformer(hidden_states=pack(x), timestep=timestep, img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
                          return_dict=False, **cond)[0]
        return unpack(out, transformer.config.out_channels, h, w)

    def guide(self, cond, uncond, scale):
        """True CFG, then rescaled to the conditional output's norm over each packed token's channels."""
        _, c, h, w = cond.shape
        cond_tokens = pack(cond)
        comb = pack(uncond) + scale * (cond_tokens - pack(uncond))
        rescaled = comb * (torch.norm(cond_tokens, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        return unpack(rescaled, c, h, w)

    def shift_seq_len(self, parts, latent_shape):
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def latent_shape(self, parts, height, width, frames):
        factor = 2 ** len(parts["vae"].temperal_downsample)
        return (parts["vae"].config.z_dim, height // factor, width // factor)

    def decode(self, parts, latents):
        vae = parts["vae"]
        mean = latents.new_tensor(vae.config.latents_mean).view(1, -1, 1, 1)
        std = latents.new_tensor(vae.config.latents_std).view(1, -1, 1, 1)
        z = (latents * std + mean).unsqueeze(2).to(vae.dtype)
        return to_unit_range(vae.decode(z, return_dict=False)[0][:, :, 0])

    def encode_images(self, parts, pixels):
        vae = parts["vae"]
        z = posterior_mean(vae.encode(from_unit_range(pixels, vae).unsqueeze(2), return_dict=True))[:, :, 0].float()
        mean = z.new_tensor(vae.config.latents_mean).view(1, -1, 1, 1)
        std = z.new_tensor(vae.config.latents_std).view(1, -1, 1, 1)
        return (z - mean) / std
