"""Random-weights Qwen2.5-Omni model directories: config.json, tokenizer and spk_dict.pt, no
weights. Every process that loads one (each of the thinker, talker, token2wav and vocoder roles)
builds the same seeded weights of its part on its device (`checkpoint.load_part`).

`full_size`: Qwen2.5-Omni-7B's architecture, 10.7 B parameters: the thinker's 7 B language model
with its audio (0.64 B) and vision (0.67 B) towers, the talker (1.35 B), token2wav (0.45 B).
transformers' `Qwen2_5OmniConfig` defaults hold for all but two parts, which the published
config.json sets: the talker (896 wide, 24 layers; the defaults give a 6.6 B one, the thinker's
width) and the vision tower (1,280 wide; the defaults give 3.1 B). The fixture's tokenizer (ids
only need to fit the 152,064-row embedding) and speakers of the real widths; token2wav's codec
embedding has a row for each of the talker's 8,448 ids (not 8,193), as the tiny fixture's has.
Otherwise the tiny fixture's config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5OmniConfig

from omni_common.models.qwen_omni.checkpoint import SPEAKERS_FILE
from omni_common.models.qwen_omni.fixture import (
    MEL_DIM,
    REF_MEL_FRAMES,
    SPEAKERS,
    build_config,
    build_tiny_fixture,
    build_tokenizer,
)
from omni_common.models.qwen_omni.processor import preprocessor_config
from omni_common.models.weights import RANDOM_WEIGHTS_FILE

# Where Qwen2.5-Omni-7B's config.json differs from transformers' defaults (the parts' sizes).
TALKER_7B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 18944,
}
VISION_7B = {"hidden_size": 1280}


def full_size_config(tokenizer: Any) -> Qwen2_5OmniConfig:
    """Qwen2.5-Omni-7B's config, its text-side special ids those of `tokenizer`."""
    config: Any = Qwen2_5OmniConfig(thinker_config={"vision_config": VISION_7B}, talker_config=TALKER_7B)
    tiny: Any = build_config(tokenizer)
    text, tiny_text = config.thinker_config.text_config, tiny.thinker_config.text_config
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(text, name, getattr(tiny_text, name))
    # Not thinker-config fields, but the real config.json has them and get_rope_index reads them.
    for name in ("vision_start_token_id", "vision_end_token_id"):
        setattr(config.thinker_config, name, getattr(tiny.thinker_config, name))
    for name in ("tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id"):
        setattr(config.talker_config, name, getattr(tiny.talker_config, name))
    # A row of token2wav's codec embedding for every code the random talker can emit (its whole
    # vocabulary), as in the tiny fixture: the real 8,193 rows would refuse the codes a trained
    # talker never draws. 255 rows more; no step computes more.
    config.token2wav_config.dit_config.num_embeds = config.talker_config.vocab_size
    return config


def write_random_model(out_dir: Path, *, full_size: bool, seed: int = 0) -> Path:
    """Write a random-weights Qwen2.5-Omni directory (configs, tokenizer, speakers) to `out_dir`."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    tokenizer = build_tokenizer()
    config: Any = full_size_config(tokenizer) if full_size else build_config(tokenizer)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The processor's settings: the published ones (audio, images and video frames).
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    width = config.token2wav_config.dit_config.enc_emb_dim
    speakers = {}
    for index, name in enumerate(SPEAKERS):
        generator = torch.Generator().manual_seed(seed + index)
        speakers[name] = {
            "cond": torch.randn(1, width, generator=generator),
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, MEL_DIM, generator=generator),
            "bos_token": tokenizer.get_vocab()[f"<|spk_{name.lower()}|>"],
        }
    torch.save(speakers, out_dir / SPEAKERS_FILE)
    (out_dir / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}) + "\n")
    return out_dir


def make_fixture(out_dir: Path, *, random_weights: str | None, seed: int = 0) -> Path:
    """`omnistage fixture` (the registry's FamilyEntry.fixture): the tiny model with its
    weights, or with random_weights "tiny" or "full" the configs only."""
    if random_weights:
        return write_random_model(out_dir, full_size=random_weights == "full", seed=seed)
    return build_tiny_fixture(out_dir, seed=seed)
