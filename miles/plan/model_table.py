"""Parameter counts of checkpoints that are not on disk, for the dry run's memory plan. Torch-free.

The dry check estimates per-GPU memory before any weight is downloaded, so it needs each
component's parameter count. A checkpoint on disk is always read instead (its safetensors
headers: `miles.plan.memory_plan.read_checkpoint`). This table covers the rest:

- RELEASED: the transformer, text-encoder, VAE and reward-model configs of the released
  checkpoints the full-scale recipes name, TRANSCRIBED BY HAND from their published
  `config.json` files (not read from the checkpoints, which are not in this repository). Only
  the keys that change parameter counts are kept; the class defaults supply the rest.
  A checkpoint missing here gets "estimate unavailable", never a guess.
- Our own checkpoints (`miles-<family>-<size>-seed<N>`): the configs `create_checkpoint` writes
  for that family and size.

The counts in `model_sizes.json` are COMPUTED, not typed: `python3 -m miles.models.size_table`
builds every component on torch's meta device from its config (no memory, no weights) and
counts its parameters, and records the transformer's width and block count that the activation
estimate uses. tests/unit/plan/test_memory_plan.py rebuilds the table and compares.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("model_sizes.json")

_UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 256384,
             "feed_forward_proj": "gated-gelu"}
_T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
           "feed_forward_proj": "gated-gelu"}
_WAN_A14B = {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
             "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
             "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}


def _c(library: str, cls: str, config: dict[str, Any], config_class: str | None = None) -> dict[str, Any]:
    extra = {"config_class": config_class} if config_class else {}
    return {"library": library, "class": cls, "config": config, **extra}


def _checkpoint(family: str | None, components: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A checkpoint's entry: its family (None: not a diffusion model) and its components by name."""
    return {"family": family, "components": components}


RELEASED: dict[str, dict[str, Any]] = {
    "Wan2.2-T2V-A14B-Diffusers": _checkpoint("wan2_2", {
        "transformer": _c("diffusers", "WanTransformer3DModel", _WAN_A14B),
        "transformer_2": _c("diffusers", "WanTransformer3DModel", _WAN_A14B),
        "text_encoder": _c("transformers", "UMT5EncoderModel", _UMT5_XXL, "UMT5Config"),
        "vae": _c("diffusers", "AutoencoderKLWan", {"base_dim": 96, "z_dim": 16}),
    }),
    "Qwen-Image": _checkpoint("qwen_image", {
        "transformer": _c("diffusers", "QwenImageTransformer2DModel", {
            "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
            "axes_dims_rope": [16, 56, 56]}),
        # Qwen2.5-VL-7B-Instruct whole, as QwenImagePipeline loads it (model_index.json names
        # Qwen2_5_VLForConditionalGeneration): its vision tower and LM head too, though the pipeline
        # encodes text only (8.29 B; the language model alone is 7.07 B). Text and vision configs from
        # Qwen2.5-VL-7B-Instruct's config.json (untied embeddings)
        "text_encoder": _c("transformers", "Qwen2_5_VLForConditionalGeneration", {
            "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                            "tie_word_embeddings": False},
            "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                              "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                              "in_chans": 3},
            "tie_word_embeddings": False}, "Qwen2_5_VLConfig"),
        "vae": _c("diffusers", "AutoencoderKLQwenImage", {"base_dim": 96, "z_dim": 16}),
    }),
    "stable-diffusion-3.5-medium": _checkpoint("sd3", {
        "transformer": _c("diffusers", "SD3Transformer2DModel", {
            "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
            "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
            "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"}),
        "text_encoder": _c("transformers", "CLIPTextModelWithProjection", {
            "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
            "projection_dim": 768, "vocab_size": 49408, "max_position_embeddings": 77}, "CLIPTextConfig"),
        "text_encoder_2": _c("transformers", "CLIPTextModelWithProjection", {
            "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
            "projection_dim": 1280, "vocab_size": 49408, "max_position_embeddings": 77}, "CLIPTextConfig"),
        "text_encoder_3": _c("transformers", "T5EncoderModel", _T5_XXL, "T5Config"),
        "vae": _c("diffusers", "AutoencoderKL", {
            "in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
            "layers_per_block": 2, "use_quant_conv": False, "use_post_quant_conv": False,
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}),
    }),
    "Cosmos-Predict2-2B-Text2Image": _checkpoint("cosmos3", {
        "transformer": _c("diffusers", "CosmosTransformer3DModel", {
            "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
            "num_layers": 28, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
            "max_size": [128, 240, 240], "patch_size": [1, 2, 2], "rope_scale": [1.0, 4.0, 4.0],
            "concat_padding_mask": True, "extra_pos_embed_type": None}),
        # the T5-11B encoder
        "text_encoder": _c("transformers", "T5EncoderModel", {
            "d_model": 1024, "d_ff": 65536, "d_kv": 128, "num_heads": 128, "num_layers": 24, "vocab_size": 32128,
            "feed_forward_proj": "relu"}, "T5Config"),
        "vae": _c("diffusers", "AutoencoderKLWan", {"base_dim": 96, "z_dim": 16}),
    }),
    # LTX-2.3 in diffusers layout (LTX2Pipeline; the Hub repository diffusers/LTX-2.3-Diffusers). Transcribed from diffusers' own converter,
    # scripts/convert_ltx2_to_diffusers.py at huggingface/diffusers 58eb52c0 (its `version == "2.3"`
    # branches: transformer, connectors, video VAE, audio VAE, vocoder; the video VAE without
    # timestep conditioning, the converter's default), every key of those branches kept. Its text
    # encoder is Gemma-3-12B (the converter's default google/gemma-3-12b-it-qat-q4_0-unquantized,
    # loaded whole as Gemma3ForConditionalGeneration, the SigLIP vision tower included: the
    # pipeline loads it though it encodes text only): text and vision configs from Gemma-3-12B's
    # config.json.
    "LTX-2.3-Diffusers": _checkpoint("ltx2", {
        "transformer": _c("diffusers", "LTX2VideoTransformer3DModel", {
            "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
            "attention_head_dim": 128, "cross_attention_dim": 4096, "vae_scale_factors": [8, 32, 32],
            "pos_embed_max_pos": 20, "base_height": 2048, "base_width": 2048, "gated_attn": True,
            "cross_attn_mod": True, "audio_in_channels": 128, "audio_out_channels": 128, "audio_patch_size": 1,
            "audio_patch_size_t": 1, "audio_num_attention_heads": 32, "audio_attention_head_dim": 64,
            "audio_cross_attention_dim": 2048, "audio_scale_factor": 4, "audio_pos_embed_max_pos": 20,
            "audio_sampling_rate": 16000, "audio_hop_length": 160, "audio_gated_attn": True,
            "audio_cross_attn_mod": True, "num_layers": 48, "activation_fn": "gelu-approximate",
            "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6,
            "caption_channels": 3840, "attention_bias": True, "attention_out_bias": True, "rope_theta": 10000.0,
            "rope_double_precision": True, "causal_offset": 1, "timestep_scale_multiplier": 1000,
            "cross_attn_timestep_scale_multiplier": 1000, "rope_type": "split", "use_prompt_embeddings": False,
            "perturbed_attn": True}),
        "connectors": _c("ltx2", "LTX2TextConnectors", {
            "caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 32,
            "video_connector_attention_head_dim": 128, "video_connector_num_layers": 8,
            "video_connector_num_learnable_registers": 128, "video_gated_attn": True,
            "audio_connector_num_attention_heads": 32, "audio_connector_attention_head_dim": 64,
            "audio_connector_num_layers": 8, "audio_connector_num_learnable_registers": 128, "audio_gated_attn": True,
            "connector_rope_base_seq_len": 4096, "rope_theta": 10000.0, "rope_double_precision": True,
            "causal_temporal_positioning": False, "rope_type": "split", "per_modality_projections": True,
            "video_hidden_dim": 4096, "audio_hidden_dim": 2048, "proj_bias": True}),
        "text_encoder": _c("transformers", "Gemma3ForConditionalGeneration", {
            "text_config": {"hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16,
                            "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360,
                            "vocab_size": 262208},
            "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                              "num_attention_heads": 16, "patch_size": 14, "image_size": 896},
            "mm_tokens_per_image": 256}, "Gemma3Config"),
        "vae": _c("diffusers", "AutoencoderKLLTX2Video", {
            "in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": [256, 512, 1024, 1024],
            "down_block_types": ["LTX2VideoDownBlock3D"] * 4, "decoder_block_out_channels": [256, 512, 512, 1024],
            "layers_per_block": [4, 6, 4, 2, 2], "decoder_layers_per_block": [4, 6, 4, 2, 2],
            "spatio_temporal_scaling": [True] * 4, "decoder_spatio_temporal_scaling": [True] * 4,
            "decoder_inject_noise": [False] * 5,
            "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
            "upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"],
            "upsample_residual": [False] * 4, "upsample_factor": [2, 2, 1, 2], "timestep_conditioning": False,
            "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-6, "encoder_causal": True,
            "decoder_causal": False, "encoder_spatial_padding_mode": "zeros", "decoder_spatial_padding_mode": "zeros",
            "spatial_compression_ratio": 32, "temporal_compression_ratio": 8}),
        "audio_vae": _c("diffusers", "AutoencoderKLLTX2Audio", {
            "base_channels": 128, "output_channels": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2,
            "attn_resolutions": None, "in_channels": 2, "resolution": 256, "latent_channels": 8, "norm_type": "pixel",
            "causality_axis": "height", "dropout": 0.0, "mid_block_add_attention": False, "sample_rate": 16000,
            "mel_hop_length": 160, "is_causal": True, "mel_bins": 64, "double_z": True}),
        "vocoder": _c("ltx2", "LTX2VocoderWithBWE", {
            "in_channels": 128, "hidden_channels": 1536, "out_channels": 2,
            "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4], "upsample_factors": [5, 2, 2, 2, 2, 2],
            "resnet_kernel_sizes": [3, 7, 11], "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
            "act_fn": "snakebeta", "leaky_relu_negative_slope": 0.1, "antialias": True, "antialias_ratio": 2,
            "antialias_kernel_size": 12, "final_act_fn": None, "final_bias": False, "bwe_in_channels": 128,
            "bwe_hidden_channels": 512, "bwe_out_channels": 2, "bwe_upsample_kernel_sizes": [12, 11, 4, 4, 4],
            "bwe_upsample_factors": [6, 5, 2, 2, 2], "bwe_resnet_kernel_sizes": [3, 7, 11],
            "bwe_resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "bwe_act_fn": "snakebeta",
            "bwe_leaky_relu_negative_slope": 0.1, "bwe_antialias": True, "bwe_antialias_ratio": 2,
            "bwe_antialias_kernel_size": 12, "bwe_final_act_fn": None, "bwe_final_bias": False,
            "filter_length": 512, "hop_length": 80, "window_length": 512, "num_mel_channels": 64,
            "input_sampling_rate": 16000, "output_sampling_rate": 48000}),
    }),
    # the reward model the PickScore recipes name (a CLIP ViT-H/14)
    "PickScore_v1": _checkpoint(None, {
        "model": _c("transformers", "CLIPModel", {
            "text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                            "num_attention_heads": 16, "vocab_size": 49408, "max_position_embeddings": 77},
            "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                              "num_attention_heads": 16, "patch_size": 14, "image_size": 224},
            "projection_dim": 1024}, "CLIPConfig"),
    }),
}

OWN_SIZES = ("tiny", "proxy")


def own_key(family: str, size: str) -> str:
    return f"miles-{family}-{size}"


@lru_cache(maxsize=1)
def load_table() -> dict[str, Any]:
    """{checkpoint key: {"family", "components": {name: {"class", "params", "hidden"?, "blocks"?}}}}."""
    return json.loads(TABLE_PATH.read_text())
