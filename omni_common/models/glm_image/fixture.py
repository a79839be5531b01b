"""A tiny, random, offline GLM-Image checkpoint in diffusers' layout, built deterministically.

Component sizes follow diffusers' own GlmImagePipeline tests (DiT 2 layers of 2 x 8 heads,
AR text model 2 layers of hidden 32, vision encoder 2 blocks, VAE 4 blocks of 4..16 channels,
T5 2 layers), with three changes so that nothing is downloaded and the checkpoint stays small:

- the AR processor's tokenizer is built here: ids 0..127 are the vision tokens (the VQ
  codebook, which is also the AR head's vocabulary, so the AR can only sample image tokens, as
  the trained model does in practice), then image start/end and the chat specials, then a
  byte-level BPE trained on a fixed corpus (the real vocabulary has 168,064 entries; this one
  ~440, which keeps the embedding table small);
- the image processor patches at 16 pixels with no merge and no temporal patch, and never
  rescales an image of at least 16x16, so that a condition image of WxH (multiples of 32)
  gets (W/32)(H/32) AR tokens, upsampled 2x to the DiT's (W/16)(H/16) grid, as
  GlmImagePipeline requires;
- the glyph tokenizer is ByT5's byte-level one (no files), with a 2-layer T5 encoder.

Weights are seeded per component and saved in float32; the dtype is chosen at load time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline
from diffusers.models.transformers.transformer_glm_image import GlmImageTransformer2DModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    ByT5Tokenizer,
    GlmImageConfig,
    GlmImageForConditionalGeneration,
    GlmImageProcessor,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)
from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

from omni_common.models.model_defaults import ModelDefaults, write_model_defaults

# The fixture's own defaults (its omnistage.json): the family's 1024x1024 makes the random AR
# prior sample over a thousand tokens; 64x64 in 4 steps answers in about a second on a CPU.
FIXTURE_DEFAULTS = ModelDefaults({"width": 64, "height": 64, "num_inference_steps": 4})

VISION_TOKENS = 128  # VQ codebook size = the AR head's vocabulary = the DiT's prior embedding rows
IMAGE_START, IMAGE_END = VISION_TOKENS, VISION_TOKENS + 1
SPECIAL_TOKENS = (
    "<|image_start|>",  # = IMAGE_START; the processor's bos: generation starts after it
    "<|image_end|>",  # = IMAGE_END; the AR's eos
    "<|endoftext|>",  # pad
    "<|image|>",  # placeholder of a condition image's tokens
    "<sop>",  # grid spec "<sop>H W<eop>" of a target image, in AR tokens
    "<eop>",
    "<|user|>",
    "<|assistant|>",
    "[gMASK]",
)
CHAT_TEMPLATE = (
    "[gMASK]{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image_start|><|image|><|image_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}<|assistant|>\n"
)
CORPUS = (
    "a photo of a cat on a mat",
    "a red fox in the snow under a blue sky",
    "a shop sign that says 'open' next to a door",
    "make it red, add a hat, remove the background",
    "0123456789 the number of the house",
)
HIDDEN = 32


def build_ar_tokenizer(vision_tokens: int = VISION_TOKENS) -> PreTrainedTokenizerFast:
    """The AR processor's tokenizer: vision tokens, specials at fixed ids (image start and end
    right after the vision tokens, as in the real vocabulary), then byte-level BPE."""
    vocab = {f"<|vision_{i}|>": i for i in range(vision_tokens)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=dict(vocab), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(vocab) + 300,
        special_tokens=list(vocab),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|image_start|>",
        eos_token="<|image_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image|>",
            "grid_bos_token": "<sop>",
            "grid_eos_token": "<eop>",
        },
    )


def build_processor(vision_tokens: int = VISION_TOKENS) -> GlmImageProcessor:
    image_processor = GlmImageImageProcessorPil(
        patch_size=16,
        merge_size=1,
        temporal_patch_size=1,
        size={"shortest_edge": 16 * 16, "longest_edge": 2048 * 2048},
    )
    return GlmImageProcessor(
        image_processor=image_processor,
        tokenizer=build_ar_tokenizer(vision_tokens),
        chat_template=CHAT_TEMPLATE,
    )


def build_ar_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> GlmImageForConditionalGeneration:
    vocab = tokenizer.get_vocab()
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": HIDDEN,
            "intermediate_size": HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "vision_vocab_size": VISION_TOKENS,
            "rope_parameters": {"mrope_section": [4, 2, 2], "rope_type": "default", "rope_theta": 10000.0},
            "pad_token_id": vocab["<|endoftext|>"],
            "eos_token_id": IMAGE_END,
        },
        vision_config={
            "depth": 2,
            "hidden_size": HIDDEN,
            "num_heads": 2,
            "image_size": 32,
            "patch_size": 16,
            "intermediate_size": HIDDEN,
        },
        vq_config={"embed_dim": HIDDEN, "num_embeddings": VISION_TOKENS, "latent_channels": HIDDEN},
        image_token_id=vocab["<|image|>"],
        image_start_token_id=IMAGE_START,
        image_end_token_id=IMAGE_END,
    )
    torch.manual_seed(seed)
    return GlmImageForConditionalGeneration(config).eval()


def build_components(seed: int = 0) -> dict[str, object]:
    """Every component of a GlmImagePipeline, seeded (each from its own manual_seed)."""
    processor = build_processor()
    vision_language_encoder = build_ar_model(processor.tokenizer, seed)
    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=384,  # ByT5: 3 specials + 256 bytes + 125 extra ids
            d_model=HIDDEN,
            d_kv=8,
            d_ff=HIDDEN,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
        )
    ).eval()
    torch.manual_seed(seed)
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=HIDDEN,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=VISION_TOKENS,
    )
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=(4, 8, 16, 16),
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=128,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return {
        "tokenizer": ByT5Tokenizer(),
        "processor": processor,
        "text_encoder": text_encoder,
        "vision_language_encoder": vision_language_encoder,
        "vae": vae,
        "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(),
    }


def build_tiny_fixture(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny GLM-Image pipeline to `out_dir` (diffusers layout); returns it. A
    directory that already holds one is kept."""
    out_dir = Path(out_dir)
    if (out_dir / "model_index.json").is_file():
        return out_dir
    pipe: Any = GlmImagePipeline(**build_components(seed))
    pipe.save_pretrained(out_dir)
    write_model_defaults(out_dir, FIXTURE_DEFAULTS)
    return out_dir
