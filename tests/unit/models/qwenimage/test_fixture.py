"""The tiny Qwen-Image fixture: loads offline in diffusers, matches the real tokenizer's
34-token system prefix, and is built byte for byte the same every time."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from diffusers import QwenImagePipeline

from omni_common.models.qwenimage.fixture import build_tiny_fixture
from omni_common.models.qwenimage.prompt_template import PROMPT_TEMPLATE, PROMPT_TEMPLATE_DROP


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_fixture_loads_in_diffusers_offline(reference_pipeline) -> None:
    pipe = reference_pipeline(torch.float32)
    assert isinstance(pipe, QwenImagePipeline)
    assert pipe.vae_scale_factor == 4  # temperal_downsample [False, True]
    assert pipe.scheduler.config.use_dynamic_shifting
    assert pipe.text_encoder.config.text_config.hidden_size == 16
    assert pipe.transformer.config.joint_attention_dim == 16


def test_template_constants_match_the_pipeline(reference_pipeline) -> None:
    pipe = reference_pipeline(torch.float32)
    assert pipe.prompt_template_encode == PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == PROMPT_TEMPLATE_DROP == 34


def test_system_prefix_is_34_tokens(reference_pipeline) -> None:
    tokenizer = reference_pipeline(torch.float32).tokenizer
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    ids = tokenizer(prefix).input_ids
    assert len(ids) == 34
    # The prefix stays a prefix when a prompt follows it, so dropping 34 tokens is exact.
    full = tokenizer(PROMPT_TEMPLATE.format("a red cat")).input_ids
    assert full[:34] == ids


def test_vision_token_ids_exist_in_the_tokenizer(reference_pipeline) -> None:
    pipe = reference_pipeline(torch.float32)
    config, tokenizer = pipe.text_encoder.config, pipe.tokenizer
    for token_id in (
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    ):
        assert tokenizer.convert_ids_to_tokens(token_id).startswith("<|")
    assert config.text_config.vocab_size == len(tokenizer)


def test_build_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    again = build_tiny_fixture(tmp_path / "again")
    assert _hashes(again) == _hashes(tiny_model)
    assert any(name.endswith(".safetensors") for name in _hashes(again))


def test_wider_text_heads(tmp_path: Path) -> None:
    out = build_tiny_fixture(tmp_path / "wide", head_dim=32)
    pipe = QwenImagePipeline.from_pretrained(out)
    text_config = pipe.text_encoder.config.text_config
    assert text_config.hidden_size // text_config.num_attention_heads == 32
    assert pipe.transformer.config.joint_attention_dim == text_config.hidden_size
