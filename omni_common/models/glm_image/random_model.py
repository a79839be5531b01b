"""Random-weights GLM-Image model directories: configs, processor and tokenizers, no weights.

Every process that loads one builds the same seeded weights of its components on its device
(omni_common.models.weights). `full_size` gives GLM-Image's real architecture for GPU
measurements: the AR model at transformers' `GlmImageConfig` defaults (text 4096 x 40 layers,
vocabulary 168,064, vision encoder and VQ of 16,384 codes; its vision head the codebook's
16,384 rows, not 16,512: random weights sample image codes only), the DiT at
diffusers' `GlmImageTransformer2DModel` defaults (30 layers, 64 heads of 40), a 16-channel
`AutoencoderKL` (128..512 channels) and a ByT5-small glyph encoder; the AR processor is the
fixture's with the real vision vocabulary (ids 0..16,383, then image start 16,384 and end 16,385,
as the real tokenizer numbers them). Otherwise the tiny fixture's configs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_glm_image import GlmImageTransformer2DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import ByT5Tokenizer, GlmImageConfig, T5Config

from omni_common.models.glm_image.fixture import build_processor, build_tiny_fixture
from omni_common.models.weights import RANDOM_WEIGHTS_FILE

VQ_CODES = 16384
MODEL_INDEX = {
    "_class_name": "GlmImagePipeline",
    "processor": ["glm_image", "GlmImageProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "ByT5Tokenizer"],
    "transformer": ["diffusers", "GlmImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "vision_language_encoder": ["glm_image", "GlmImageForConditionalGeneration"],
}
# GLM-Image's published text rope: half of each 128-wide head rotates, in 3-D sections (not
# every transformers version has these as defaults: 5.17 fails a prefill without them).
TEXT_ROPE = {
    "partial_rotary_factor": 0.5,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [8, 12, 12],
        "partial_rotary_factor": 0.5,
    },
}
# google/byt5-small's encoder (d_model 1472 = the DiT's text_embed_dim).
BYT5_SMALL: dict[str, Any] = {
    "vocab_size": 384,
    "d_model": 1472,
    "d_kv": 64,
    "d_ff": 3584,
    "num_layers": 12,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
}


def write_random_model(out_dir: Path, *, full_size: bool, seed: int = 0) -> Path:
    """Write a random-weights GLM-Image directory to `out_dir` (replacing what is there)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    if full_size:
        _write_full_size_configs(out_dir)
    else:
        build_tiny_fixture(out_dir, seed=seed)
        for weights in out_dir.glob("*/*.safetensors"):
            weights.unlink()
    (out_dir / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}) + "\n")
    return out_dir


def _write_full_size_configs(out_dir: Path) -> None:
    out_dir.mkdir(parents=True)
    (out_dir / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")
    processor = build_processor(VQ_CODES)
    processor.save_pretrained(out_dir / "processor")
    ByT5Tokenizer().save_pretrained(out_dir / "tokenizer")
    vocab = processor.tokenizer.get_vocab()
    GlmImageConfig(
        text_config={
            # The head samples image codes only, as in the tiny fixture: random weights would
            # otherwise draw the vision vocabulary's other ids (image start/end and unused
            # ones) mid-grid, which no DiT takes. 128 rows fewer than the real 16,512 (1 MB
            # of the 16.45 GB a decode step reads); the prior ends at its grid's length.
            "vision_vocab_size": VQ_CODES,
            "pad_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|image_end|>"],
            **TEXT_ROPE,
        },
        image_token_id=vocab["<|image|>"],
        image_start_token_id=vocab["<|image_start|>"],
        image_end_token_id=vocab["<|image_end|>"],
    ).save_pretrained(out_dir / "vision_language_encoder")
    T5Config(**BYT5_SMALL).save_pretrained(out_dir / "text_encoder")
    with torch.device("meta"):  # the configs only: a meta model holds no memory
        GlmImageTransformer2DModel().save_config(out_dir / "transformer")
        AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=16,
            sample_size=1024,
            latents_mean=[0.0] * 16,
            latents_std=[1.0] * 16,
        ).save_config(out_dir / "vae")
    FlowMatchEulerDiscreteScheduler().save_config(out_dir / "scheduler")


def make_fixture(out_dir: Path, *, random_weights: str | None, seed: int = 0) -> Path:
    """`omnistage fixture` (the registry's FamilyEntry.fixture): the tiny model with its
    weights, or with random_weights "tiny" or "full" the configs only."""
    if random_weights:
        return write_random_model(out_dir, full_size=random_weights == "full", seed=seed)
    return build_tiny_fixture(out_dir, seed=seed)
