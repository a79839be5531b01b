"""Image conversions shared by the stages: float tensors to 8-bit pixels and PNG."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def to_rgb8(image: torch.Tensor) -> np.ndarray:
    """float [3, H, W] in [0, 1] -> uint8 [H, W, 3], quantised exactly as diffusers' numpy_to_pil."""
    return (image.permute(1, 2, 0).float().numpy() * 255).round().astype(np.uint8)


def to_png(pixels: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes (fast compression: this is on the request path)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
