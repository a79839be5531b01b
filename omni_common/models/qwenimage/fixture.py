"""A tiny, random, offline Qwen-Image checkpoint in diffusers' layout, built deterministically.

The component configs are those of diffusers' own QwenImage pipeline tests; the tokenizer is a
byte-level BPE trained here on a fixed corpus, so that the pipeline's chat-template system
prefix is exactly 34 tokens, as it is with the real Qwen2.5-VL tokenizer (the pipeline drops
34 tokens). Weights are saved in float32; the dtype is chosen at load time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from omni_common.models.qwenimage.encode import PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP

SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Every word of the chat template and a few prompt words, so each becomes one token.
FIXTURE_PROMPTS = (
    "a red cat sitting on a blue mat",
    "a photo of a dog under a green tree near a small house",
    "a painting of mountains, a lake, and the sky at sunset",
    "blurry, low quality, watermark",
)
# Qwen-Image's own scheduler config: dynamic (resolution-dependent) exponential shifting.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def build_tokenizer(prompts: Sequence[str] = FIXTURE_PROMPTS) -> Qwen2Tokenizer:
    """A small Qwen2 byte-level BPE with the chat and vision special tokens, trained on the chat
    template filled with `prompts` (so their words become single tokens)."""
    corpus = [PROMPT_TEMPLATE.format(text) for text in prompts]
    base = Qwen2Tokenizer()  # empty vocab, Qwen2's pre-tokenizer; <|endoftext|> is pad/eos
    # show_progress off: the trainer's bar printed blank lines into every fixture build.
    tokenizer = base.train_new_from_iterator(
        [corpus], vocab_size=1024, new_special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    n_prefix = len(tokenizer(prefix).input_ids)
    if n_prefix != PROMPT_TEMPLATE_DROP:  # the pipeline's hard-coded drop index relies on it
        raise RuntimeError(f"fixture tokenizer: system prefix is {n_prefix} tokens, not 34")
    return tokenizer


def build_text_encoder(
    tokenizer: Qwen2Tokenizer, hidden_size: int, head_dim: int
) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL with 2 text layers of 2 heads; mrope sections scale with head_dim."""
    quarter = head_dim // 8

    def ids(token: str) -> int:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(token_id, int)
        return token_id

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_window_layers": 2,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [quarter, quarter, 2 * quarter],
                "rope_theta": 1000000.0,
            },
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_fixture(out_dir: Path, *, head_dim: int = 8, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image checkpoint to `out_dir` and return it.

    `head_dim` sets the text encoder's head size (hidden = 2 heads x head_dim, and the DiT's
    joint_attention_dim follows); the default 8 gives diffusers' test config (hidden 16).
    vLLM's CPU attention needs head_dim >= 32. Building twice gives identical files.
    """
    if head_dim < 8 or head_dim % 8:
        raise ValueError("head_dim must be a positive multiple of 8")
    hidden_size = 2 * head_dim
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=hidden_size,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=4 * 6,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    torch.manual_seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    text_encoder = build_text_encoder(tokenizer, hidden_size, head_dim)
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
