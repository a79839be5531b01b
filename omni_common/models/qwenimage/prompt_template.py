"""Qwen-Image's prompt format, as `QwenImagePipeline` encodes a prompt: the chat template, the
system prefix it drops, and the tokenizer's limit. Plain constants, so the family card (which
the coordinator imports) and the encoders share them without importing each other."""

from __future__ import annotations

TOKENIZER_MAX_LENGTH = 1024  # what the pipeline's tokenizer call allows after the template

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34  # tokens of the system prefix, dropped from the embeddings
