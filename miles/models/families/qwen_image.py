"""Qwen-Image: QwenImageTransformer2DModel over the Qwen-Image VAE, conditioned by a Qwen LM.

The transformer takes 2x2-packed latent tokens; latents stay [C, h, w] everywhere else and are
packed around each forward. The text encoder's last hidden state (padding zeroed) and its mask are
the conditioning. Released checkpoints wrap prompts in a chat template and drop its prefix; that
is a quality detail we leave out, the tensors' meaning is the same.
"""

from __future__ import annotations

from miles.models.families.base import (
    ComponentSpec, FamilyModule, encode_with_mask, from_unit_range, posterior_mean, to_unit_range,
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
    text_max_length = 512

    def components(self, size):
        if size == "tiny":
            z, text_width, max_len = 4, 32, 16
            transformer = dict(patch_size=2, in_channels=4 * z, out_channels=z, num_layers=2, attention_head_dim=16,
                               num_attention_heads=2, joint_attention_dim=text_width, axes_dims_rope=(4, 6, 6))
            text = dict(hidden_size=text_width, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64)
            vae = dict(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, False, False],
                       latents_mean=[0.0] * z, latents_std=[1.0] * z)
        elif size == "proxy":
            z, text_width, max_len = 16, 1536, 512
            transformer = dict(patch_size=2, in_channels=4 * z, out_channels=z, num_layers=20, attention_head_dim=128,
                               num_attention_heads=16, joint_attention_dim=text_width, axes_dims_rope=(16, 56, 56))
            text = dict(hidden_size=text_width, intermediate_size=8960, num_hidden_layers=8, num_attention_heads=12,
                        num_key_value_heads=2, max_position_embeddings=2048)
            vae = dict(base_dim=96, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
        else:
            raise ValueError(f"unknown size {size!r}")
        text.update(vocab_size=len(vocabulary()), pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        return {
            "transformer": ComponentSpec("diffusers", "QwenImageTransformer2DModel", transformer),
            "text_encoder": ComponentSpec("transformers", "Qwen2Model", text, config_class="Qwen2Config"),
            "tokenizer": ComponentSpec("transformers", "PreTrainedTokenizerFast", {"model_max_length": max_len}),
            "vae": ComponentSpec("diffusers", "AutoencoderKLQwenImage", vae),
        }

    def encode(self, parts, prompts):
        hidden, mask = encode_with_mask(parts, prompts, self.text_max_length)
        return {"encoder_hidden_states": hidden, "encoder_hidden_states_mask": mask}

    def forward(self, parts, transformer, x, sigma, cond):
        _, c, h, w = x.shape
        out = transformer(hidden_states=pack(x), timestep=sigma.to(x.dtype), img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0],
                          return_dict=False, **cond)[0]
        return unpack(out, transformer.config.out_channels, h, w)

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
