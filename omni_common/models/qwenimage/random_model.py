"""Random-weights Qwen-Image model directories: configs, tokenizer and scheduler, no weights.

Every process that loads one builds the same seeded weights on its device (see
omni_common.models.weights), so a split cluster and a diffusers baseline run the same model.
`full_size` gives Qwen-Image's real architecture (DiT 20.4 B, Qwen2.5-VL-7B, VAE 0.13 B:
the diffusers classes' defaults and Qwen2.5-VL-7B's published config) for GPU measurements;
otherwise the tiny fixture's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import Qwen2_5_VLConfig

from omni_common.models.qwenimage.fixture import SCHEDULER_CONFIG, build_tiny_fixture, build_tokenizer
from omni_common.models.weights import RANDOM_WEIGHTS_FILE

MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
# Qwen2.5-VL-7B-Instruct's config (text model and vision tower).
QWEN25_VL_7B_TEXT = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
}
QWEN25_VL_7B_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "window_size": 112,
}


def write_random_model(out_dir: Path, *, full_size: bool, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    if not full_size:
        build_tiny_fixture(out_dir, seed=seed)
        for weights in out_dir.glob("*/*.safetensors"):
            weights.unlink()
    else:
        _write_full_size_configs(out_dir)
    (out_dir / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}) + "\n")
    return out_dir


def _write_full_size_configs(out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")
    with torch.device("meta"):  # the configs only: a meta model holds no memory
        QwenImageTransformer2DModel().save_config(out_dir / "transformer")
        AutoencoderKLQwenImage().save_config(out_dir / "vae")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_config(out_dir / "scheduler")
    tokenizer = build_tokenizer()  # the fixture's: token ids only need to fit the vocabulary
    tokenizer.save_pretrained(out_dir / "tokenizer")

    def ids(token: str) -> int:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(token_id, int)
        return token_id

    text = {
        **QWEN25_VL_7B_TEXT,
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    Qwen2_5_VLConfig(
        text_config=text,
        vision_config=QWEN25_VL_7B_VISION,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    ).save_pretrained(out_dir / "text_encoder")


def make_fixture(out_dir: Path, *, random_weights: str | None, seed: int = 0, head_dim: int = 16) -> Path:
    """`omnistage fixture` (the registry's FamilyEntry.fixture): the tiny model with its
    weights, or with random_weights "tiny" or "full" the configs only."""
    if random_weights:
        return write_random_model(out_dir, full_size=random_weights == "full", seed=seed)
    return build_tiny_fixture(out_dir, seed=seed, head_dim=head_dim)
