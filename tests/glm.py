"""What the GLM-Image tests above the runners share: input pictures and diffusers' image for a
request as the cluster receives it (64x64, the family's default guidance)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from diffusers.pipelines.glm_image.pipeline_glm_image import GlmImagePipeline
from PIL import Image

from omni_common.models.base import GenerationRequest
from omni_common.models.glm_image.reference import reference_image


def png(seed: int, width: int = 64, height: int = 64) -> bytes:
    """A random RGB picture as PNG file bytes."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pipeline_image(
    pipe: GlmImagePipeline, prompt: str, seed: int, steps: int, images: Sequence[bytes] = ()
) -> torch.Tensor:
    """diffusers' float image [3, 64, 64] for the request the tests send the cluster."""
    request = GenerationRequest(
        prompt=prompt,
        width=64,
        height=64,
        num_inference_steps=steps,
        true_cfg_scale=1.5,  # GLM-Image's default, which the cluster applies
        seed=seed,
        max_sequence_length=2048,
    )
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    return reference_image(pipe, request, pictures)
