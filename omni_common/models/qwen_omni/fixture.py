"""A tiny, random, offline Qwen2.5-Omni checkpoint in transformers' layout, built deterministically.

What `Qwen2_5OmniForConditionalGeneration.save_pretrained` writes (config.json of model_type
qwen2_5_omni, model.safetensors with thinker./talker./token2wav. keys), plus the tokenizer and the
speakers' `spk_dict.pt` that `from_pretrained` and `generate` read. Sizes were shrunk so that the
whole checkpoint is 4.4 MB (float32) and one `generate` of 16 text tokens and 60 codes takes ~0.7 s
on 2 CPU cores (plus ~0.9 s of `from_pretrained`):

- thinker: text model of hidden 32, 2 layers, 4 heads of 8 (2 kv heads), mrope sections [1, 1, 2];
  the audio tower (2 layers of 16) and vision tower (2 blocks of 16) are built but unused by text
  prompts. Its vocabulary is the tokenizer's 384 entries (the real embedding has 152,064 rows),
  rounded up to a multiple of 64 as the real one is;
- the tokenizer is a Qwen2 byte-level BPE trained here on a fixed chat corpus. Every id the talker
  config or a speaker references (tts text pad/start/end, audio/vision markers, the speakers' bos)
  is a named special token here, so all of them are valid thinker ids;
- talker: hidden 32, 2 layers, 4 heads of 8, but the real codec vocabulary (8448) and codec ids
  (start 8293, end 8294, pad 8292, mask 8296), because `generate` hard-codes
  talker_eos_token_id=[8292, 8294];
- token2wav DiT: hidden 32, 4 layers of 2 heads of 16, with look-ahead in layer 1 and look-back in
  layers 0 and 2, so its receptive field is the real model's (one 24-frame block ahead, two back;
  the real one has 22 layers, ahead [10], back [0, 20]); mel_dim 80, block_size 24 and repeats 2
  are kept, and num_embeds is 8448 (not 8193) so that every code the random talker can emit has
  an embedding row. The ECAPA speaker encoder has 16-channel layers;
- BigVGAN: the real upsample rates (5, 3, 2, 2, 2, 2: a hop of 240 samples, 24 kHz at 100 mel
  frames/s) and kernel sizes, but 64 initial channels (halved at each of the 6 upsamplings down to
  1; 32 would leave 0);
- token2wav's weights are drawn with PyTorch's default init rather than transformers' N(0, 0.02),
  so that its mel depends on the codes and its waveform is not ~1e-8 (see `_reset_to_torch_init`);
- speakers "Chelsie" and "Ethan": random cond [1, enc_emb_dim] and ref_mel [1, 30, 80], and
  distinct bos ids.

A random talker's codec distribution is near uniform, so it almost never emits an eos (8292 or
8294) on its own: callers cap it with `talker_max_new_tokens` (tests use a few dozen codes).
Weights are seeded per component (thinker, talker, token2wav, speakers) and saved in float32;
two builds give byte-identical files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoTokenizer,
    Qwen2_5OmniConfig,
    Qwen2_5OmniForConditionalGeneration,
    Qwen2_5OmniTalkerForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniToken2WavModel,
    Qwen2Tokenizer,
)
from transformers.utils import logging as hf_logging

from omni_common.models.model_defaults import ModelDefaults, write_model_defaults
from omni_common.models.qwen_omni.processor import MEDIA_TOKENS, preprocessor_config

HIDDEN = 32
HEAD_DIM = 8
MROPE_SECTION = [1, 1, 2]  # sums to HEAD_DIM / 2, split like the real [16, 24, 24]
# A thinker attention for GPU kernels (tests/gpu): (query heads, head width). FlexAttention's
# kernels take heads of 16 channels or more; 3 query heads a KV head, no power of two, as the
# real 7 (inductor picks another flex kernel for a power of two).
FLEX_HEADS = (6, 16)
ENC_EMB_DIM = 16  # the speakers' "cond" width (real 192)
MEL_DIM = 80
REF_MEL_FRAMES = 30
CODEC_VOCAB = 8448
SPEAKERS = ("Chelsie", "Ethan")
# The fixture's own reply limits (its omnistage.json): random weights rarely say their end
# token, so the family's 1024 text tokens / 4096 codec tokens (~50 codes a second) ran to 30-82 s
# of noise. 16 tokens and 100 codes (2 s) answer in seconds; a request can still ask for more.
FIXTURE_DEFAULTS = ModelDefaults(options={"max_new_tokens": "16", "talker_max_new_tokens": "100"})
SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    *(f"<|spk_{name.lower()}|>" for name in SPEAKERS),
]
# Qwen2.5-Omni's template without its default system prompt: a string content as it is, a list
# of parts with each audio clip, image and video as its placeholder between its markers.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif part['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The fixture's feature extractor hears at most this many seconds (the real one 300): its
# features are padded to the window, and 30 s keeps a request's features cheap on a CPU.
FIXTURE_AUDIO_SECONDS = 30
CORPUS = (
    ("system", "You are a helpful assistant that can hear and speak."),
    ("user", "Hello, who are you?"),
    ("assistant", "I am a small test model. I speak in a random voice."),
    ("user", "Tell me a short story about a red cat and a blue dog."),
    ("assistant", "Once upon a time, the cat sat on a mat and the dog sang a song."),
    ("user", "What is the weather like today? Count from one to ten."),
)


def build_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 byte-level BPE with the chat, audio/vision, tts and speaker specials (ids 0..14,
    <|endoftext|> first) and the chat template, trained on `CORPUS` in chat format."""
    corpus = ["".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in CORPUS)]
    base = Qwen2Tokenizer()  # empty vocab, Qwen2's pre-tokenizer; <|endoftext|> is pad/eos
    # show_progress off: the trainer's bar printed blank lines into every fixture build.
    tokenizer = base.train_new_from_iterator(
        [corpus], vocab_size=384, new_special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_id(tokenizer: Qwen2Tokenizer, token: str) -> int:
    vocab = tokenizer.get_vocab()  # not convert_tokens_to_ids: Qwen2's unk is <|endoftext|>
    if token not in vocab:
        raise RuntimeError(f"fixture tokenizer lacks {token!r}")
    return vocab[token]


def build_config(tokenizer: Qwen2Tokenizer, flex_heads: bool = False) -> Qwen2_5OmniConfig:
    """The three sub-model configs, every text-side id taken from `tokenizer`. `flex_heads`:
    the thinker's attention shaped for the GPU kernels the real one's takes, FLEX_HEADS."""
    vocab_size = -(-len(tokenizer) // 64) * 64
    ids = {token: _token_id(tokenizer, token) for token in ["<|endoftext|>", *SPECIAL_TOKENS]}
    media_ids = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
    }
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION}
    decoder = {
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 2,
        "max_window_layers": 2,
        "rope_parameters": rope,
    }
    thinker_attention: dict[str, Any] = {}
    if flex_heads:
        heads, head_dim = FLEX_HEADS
        widen = head_dim // HEAD_DIM
        thinker_attention = {
            "num_attention_heads": heads,
            "head_dim": head_dim,
            "rope_parameters": {**rope, "mrope_section": [widen * size for size in MROPE_SECTION]},
        }
    thinker = {
        "text_config": {
            **decoder,
            **thinker_attention,
            "vocab_size": vocab_size,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        "audio_config": {
            "num_mel_bins": 128,  # the feature extractor's; kept
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": HIDDEN,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": HIDDEN,
            "fullatt_block_indexes": [1],
        },
        "user_token_id": ids["<|im_start|>"],  # unused by the modeling code (872 = "user" in Qwen's)
        # Not fields of the thinker config, but the real config.json has them and get_rope_index
        # reads them: without them a text prompt fails.
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
        **media_ids,
    }
    talker = {
        **decoder,
        **media_ids,
        "head_dim": HEAD_DIM,
        "embedding_size": HIDDEN,  # = the thinker's hidden size
        "vocab_size": CODEC_VOCAB,
        "tts_text_start_token_id": ids["<|tts_bos|>"],
        "tts_text_end_token_id": ids["<|tts_eos|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=_token2wav_config()
    )


def _token2wav_config() -> dict[str, Any]:
    """token2wav's config: the codec DiT and BigVGAN, which read no tokenizer id."""
    return {
        "dit_config": {
            "hidden_size": HIDDEN,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "head_dim": 16,
            "emb_dim": 16,
            "look_ahead_layers": [1],
            "look_backward_layers": [0, 2],
            "num_embeds": CODEC_VOCAB,
            "mel_dim": MEL_DIM,
            "enc_emb_dim": ENC_EMB_DIM,
            "enc_dim": 16,
            "enc_channels": [16, 16, 16, 16, 48],  # the last = the sum of the middle three
            "enc_attention_channels": 8,
            "enc_se_channels": 8,
        },
        "bigvgan_config": {"mel_dim": MEL_DIM, "upsample_initial_channel": 64},
    }


def build_speakers(tokenizer: Qwen2Tokenizer, seed: int) -> dict[str, dict[str, torch.Tensor | int]]:
    """What `generate` reads of a speaker: "cond" [1, enc_emb_dim] (expanded over the batch),
    "ref_mel" [1, T, mel_dim] and "bos_token" (a thinker id the talker's text stream starts at)."""
    speakers: dict[str, dict[str, torch.Tensor | int]] = {}
    for index, name in enumerate(SPEAKERS):
        generator = torch.Generator().manual_seed(seed + index)
        speakers[name] = {
            "cond": torch.randn(1, ENC_EMB_DIM, generator=generator),
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, MEL_DIM, generator=generator),
            "bos_token": _token_id(tokenizer, f"<|spk_{name.lower()}|>"),
        }
    return speakers


def build_model(config: Qwen2_5OmniConfig, seed: int) -> Qwen2_5OmniForConditionalGeneration:
    """The full model with each sub-model's weights drawn from its own `manual_seed`, so resizing
    one leaves the others' weights unchanged."""
    model = Qwen2_5OmniForConditionalGeneration(config)
    sub: Any = config  # its sub-configs are typed as dicts too, but __post_init__ made them configs
    builders: dict[str, Callable[[], nn.Module]] = {
        "thinker": lambda: Qwen2_5OmniThinkerForConditionalGeneration(sub.thinker_config),
        "talker": lambda: Qwen2_5OmniTalkerForConditionalGeneration(sub.talker_config),
        "token2wav": lambda: _reset_to_torch_init(Qwen2_5OmniToken2WavModel(sub.token2wav_config)),
    }
    for name, build in builders.items():
        torch.manual_seed(seed)
        getattr(model, name).load_state_dict(build().state_dict())
    return model.float().eval()


def _reset_to_torch_init(module: nn.Module) -> nn.Module:
    """Re-draw every layer with PyTorch's own fan-in-scaled init (embeddings N(0, 1)). With
    transformers' N(0, 0.02) init the DiT's mel is its input noise plus a code effect of ~1e-2 and
    BigVGAN's waveform peaks at ~5e-8, so any waveform comparison would pass; with this one the
    waveform peaks at ~0.3 and a changed code moves the mel by ~2 (measured at seed 0)."""
    for layer in module.modules():
        reset = getattr(layer, "reset_parameters", None)
        if layer is not module and callable(reset):
            reset()
    return module


def build_tiny_fixture(out_dir: Path, *, seed: int = 0, flex_heads: bool = False) -> Path:
    """Write the tiny Qwen2.5-Omni checkpoint, its tokenizer and spk_dict.pt to `out_dir`;
    returns it. Building twice gives identical files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(build_config(tokenizer, flex_heads), seed)
    was_shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for one shard of a few MB says nothing
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if was_shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out_dir)
    # The processor's parts: the tokenizer's media tokens named, and preprocessor_config.json.
    AutoTokenizer.from_pretrained(out_dir, extra_special_tokens=MEDIA_TOKENS).save_pretrained(out_dir)
    config = preprocessor_config(chunk_length=FIXTURE_AUDIO_SECONDS)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    torch.save(build_speakers(tokenizer, seed), out_dir / "spk_dict.pt")
    write_model_defaults(out_dir, FIXTURE_DEFAULTS)
    return out_dir
