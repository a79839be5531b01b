"""Qwen-Image's LoRA files: what diffusers' `QwenImagePipeline.load_lora_weights` reads.

diffusers' Qwen-Image LoRAs adapt the DiT only (`QwenImageLoraLoaderMixin` loads
"transformer" and nothing else; the text encoder takes none). `lora_state_dict` brings
diffusers' own keys (`transformer.<module>.lora_A.weight` / `.lora_B.weight`) and the other
formats it knows (Kohya's `lora_unet_*` with `lora_down` / `lora_up` and `.alpha`, ComfyUI's
`diffusion_model.*`, PEFT's `*.default.*`) to one form, with alphas folded into the weights.
"""

from __future__ import annotations

import torch
from diffusers.loaders.lora_pipeline import QwenImageLoraLoaderMixin

PREFIX = "transformer."


def read_qwenimage_lora(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter file's tensors as lora_A / lora_B weights keyed by the DiT's module paths.
    ValueError for keys that adapt anything but the DiT (e.g. a text encoder)."""
    converted = QwenImageLoraLoaderMixin.lora_state_dict(dict(tensors))
    assert isinstance(converted, dict)
    others = [key for key in converted if not key.startswith(PREFIX)]
    if others:
        raise ValueError(
            f"{others[0][:120]!r} adapts no part of the DiT (Qwen-Image takes DiT adapters only)"
        )
    return {key.removeprefix(PREFIX): value for key, value in converted.items()}
