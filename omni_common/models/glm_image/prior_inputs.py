"""What `GlmImagePipeline.generate_prior_tokens` (diffusers 0.42.1) and `generate` compute
around the AR model's sampling for one prompt: the input images and the processor's inputs
(checked so that the condition tokens match the DiT's grid), the generation parameters, the
3-D mrope positions, the logits processors and the tokens that end generation."""

from __future__ import annotations

from typing import Any, cast

import torch
from PIL import Image
from transformers import BatchFeature, GlmImageForConditionalGeneration, GlmImageProcessor

from omni_common.errors import InvalidArgument
from omni_common.imaging import decode_image, input_image_bytes
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.glm_image.grid import AR_PATCH


def condition_images(request: GenerationRequest, inputs: StageState) -> list[Image.Image]:
    """The request's input images, decoded to RGB; INVALID_ARGUMENT for a missing or undecodable
    one, or one (or a target size) whose sides are not multiples of AR_PATCH."""
    if request.width % AR_PATCH or request.height % AR_PATCH:
        raise InvalidArgument(
            f"GLM-Image makes images whose sides are multiples of {AR_PATCH}; "
            f"got {request.width}x{request.height}"
        )
    images = []
    for index in range(len(request.images)):
        image = decode_image(input_image_bytes(inputs.tensors, index).cpu(), index=index)
        if image.width % AR_PATCH or image.height % AR_PATCH or min(image.size) < AR_PATCH:
            raise InvalidArgument(
                f"input image {index} is {image.width}x{image.height}; GLM-Image needs sides that are "
                f"multiples of {AR_PATCH} pixels"
            )
        images.append(image)
    return images


def processor_inputs(
    processor: GlmImageProcessor, request: GenerationRequest, images: list[Image.Image], device: torch.device
) -> dict[str, Any]:
    """The processor's inputs for one prompt, as the pipeline builds them (no padding), on the
    device; INVALID_ARGUMENT for a condition image the processor would resize."""
    content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": request.prompt})
    messages: Any = [[{"role": "user", "content": content}]]
    try:
        encoded = processor.apply_chat_template(
            messages,
            tokenize=True,
            padding=False,
            target_h=request.height,
            target_w=request.width,
            return_dict=True,
            return_tensors="pt",
        )
        batch = cast(BatchFeature, encoded).to(device)
    except ValueError as error:  # the image processor's size and aspect ratio limits
        raise InvalidArgument(f"the AR processor cannot take the input images: {error}") from None
    grids = batch["image_grid_thw"][: len(images)].tolist()  # then the target's (and a preview's)
    for index, (image, grid) in enumerate(zip(images, grids, strict=True)):
        expected = [1, image.height // AR_PATCH, image.width // AR_PATCH]
        if grid != expected:
            raise InvalidArgument(
                f"input image {index} ({image.width}x{image.height}) would be resized by the AR "
                f"processor to a {grid[1]}x{grid[2]} token grid, which does not match the DiT's; "
                f"send images whose sides are multiples of {AR_PATCH} within the model's size limits"
            )
    return dict(batch)


def generation_params(grids: torch.Tensor, *, edit: bool) -> tuple[int, int, tuple[int, int]]:
    """(tokens to sample, where the target's tokens start among them, the target's grid), from
    the processor's grids [n, 3]. Edit mode: the condition images' grids, then the target's; the
    AR samples the target, then an end token. Text-to-image: the target's grid, then a small
    preview's; the AR samples the preview first, then the target, then an end token."""
    sizes = [(int(h), int(w)) for _, h, w in grids.tolist()]
    if edit:
        rows, columns = sizes[-1]
        return rows * columns + 1, 0, (rows, columns)
    rows, columns = sizes[0]
    preview = sum(h * w for h, w in sizes[1:])
    return rows * columns + preview + 1, preview, (rows, columns)


def rope_positions(
    model: GlmImageForConditionalGeneration,
    input_ids: torch.Tensor,
    grids: torch.Tensor,
    images_per_sample: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's 3-D mrope positions [3, 1, L] and those of the tokens to sample [3, N].
    `get_rope_index` leaves the latter on the model (`generate` reads them back from there), where
    the next request would overwrite them: they are taken and the model's copy cleared."""
    inner = model.model
    positions, _ = inner.get_rope_index(input_ids, image_grid_thw=grids, images_per_sample=images_per_sample)
    decode = inner._cached_decode_position_ids
    inner._cached_decode_position_ids = inner._prefill_len = None
    assert decode is not None, "GLM-Image prompts always carry the target's grid"
    return positions, decode[0].clone()


def eos_ids(model: GlmImageForConditionalGeneration) -> list[int]:
    """The ids that end generation, as `generate` reads them from the generation config."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
