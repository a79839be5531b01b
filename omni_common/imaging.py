"""Images in and out: float tensors to 8-bit pixels and PNG; request input images checked and
decoded."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping

import numpy as np
import torch
from PIL import Image

from omni_common.errors import InvalidArgument
from omni_common.input_media import INPUT_PREFIX, ImageInput, input_image_name


def to_rgb8(image: torch.Tensor) -> np.ndarray:
    """float [3, H, W] in [0, 1] -> uint8 [H, W, 3], quantised exactly as diffusers' numpy_to_pil
    (float32 x 255, rounded half to even: the same bits on any device). Quantised where the
    image is, so a GPU's image crosses to the host as one byte a value, not four."""
    return (image.permute(1, 2, 0).float() * 255).round().to(torch.uint8).cpu().numpy()


def to_png(pixels: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes (fast compression: this is on the request path)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


# Input images: checked from their headers (no pixels decoded) by the coordinator and again by
# each stage that receives one, decoded only by the runner that uses it.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_SIDE = 4096


def inspect_image(data: bytes, *, index: int = 0, max_pixels: int, label: str = "") -> ImageInput:
    """What a request's `index`-th input image (or what `label` names: a video's frame) is,
    from its header; INVALID_ARGUMENT for a file that is empty, too large, not an image of a
    known format, or of unusable size."""
    label = label or f"input image {index}"
    if not data:
        raise InvalidArgument(f"{label} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidArgument(f"{label} is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            width, height, kind = image.width, image.height, str(image.format)
    except (Image.DecompressionBombError, Image.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidArgument(
            f"{label} is not a readable image; send a {', '.join(IMAGE_FORMATS)} file"
        ) from None
    if width < 1 or height < 1 or width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE:
        raise InvalidArgument(f"{label} is {width}x{height}; each side must be in [1, {MAX_IMAGE_SIDE}]")
    if width * height > max_pixels:
        raise InvalidArgument(
            f"{label} is {width}x{height} = {width * height} pixels; this server allows at most {max_pixels}"
        )
    return ImageInput(width, height, kind, hashlib.sha256(data).hexdigest())


def input_images(tensors: Mapping[str, torch.Tensor], *, max_pixels: int) -> tuple[ImageInput, ...]:
    """The input images among a stage call's tensors (`input.image.0`, `.1`, ...), checked."""
    found: list[ImageInput] = []
    while input_image_name(len(found)) in tensors:
        tensor = input_image_bytes(tensors, len(found))
        found.append(inspect_image(image_bytes(tensor), index=len(found), max_pixels=max_pixels))
    extra = [name for name in tensors if name.startswith(INPUT_PREFIX + "image.")]
    if len(extra) != len(found):
        raise InvalidArgument("input images must be numbered from 0 without gaps")
    return tuple(found)


def input_image_bytes(tensors: Mapping[str, torch.Tensor], index: int) -> torch.Tensor:
    """Input image `index` among a call's tensors: its file bytes, a 1-D uint8 tensor;
    INVALID_ARGUMENT when it is missing or anything else."""
    tensor = tensors.get(input_image_name(index))
    if tensor is None or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise InvalidArgument(
            f"input image {index} ({input_image_name(index)}) must be a 1-D uint8 tensor of file bytes"
        )
    return tensor


def image_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def decode_image(tensor: torch.Tensor, *, index: int = 0) -> Image.Image:
    """An input image tensor (file bytes) as an RGB PIL image."""
    return decode_image_file(image_bytes(tensor), label=f"input image {index}")


def decode_image_file(data: bytes, *, label: str) -> Image.Image:
    """An image file's bytes as an RGB PIL image; INVALID_ARGUMENT naming `label` if they do
    not decode."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            return image.convert("RGB")
    except (Image.DecompressionBombError, Image.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidArgument(f"{label} could not be decoded") from None
