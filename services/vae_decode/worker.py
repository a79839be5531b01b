"""vae-decode worker: latents -> image, as PNG bytes, raw RGB8 pixels and/or the float tensor.

Only the outputs the caller asks for are made: encoding a PNG costs more than moving the
raw pixels on one host.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator

import numpy as np
import torch
from PIL import Image

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import Worker
from omnistage.v1 import stage_pb2

OUTPUTS = frozenset({"png", "rgb8", "image"})
DEFAULT_OUTPUTS = frozenset({"png"})


def to_rgb8(image: torch.Tensor) -> np.ndarray:
    """float [3, H, W] in [0, 1] -> uint8 [H, W, 3], quantised exactly as diffusers' numpy_to_pil."""
    return (image.permute(1, 2, 0).float().numpy() * 255).round().astype(np.uint8)


def to_png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


class DecodeWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_decoder(config.model_dir, self.device, self.dtype)

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    def _decode(self, inputs: StageState, outputs: frozenset[str]) -> StageState:
        (image,) = self.runner.decode([inputs])
        image = image.cpu()
        tensors: dict[str, torch.Tensor] = {}
        if "image" in outputs:
            tensors["image"] = image
        if outputs & {"png", "rgb8"}:
            pixels = to_rgb8(image)
            if "rgb8" in outputs:
                tensors["rgb8"] = torch.from_numpy(pixels)
            if "png" in outputs:
                tensors["png"] = torch.frombuffer(bytearray(to_png(pixels)), dtype=torch.uint8)
        return StageState(tensors, {"height": str(image.shape[1]), "width": str(image.shape[2])})

    async def run(
        self, request: GenerationRequest, inputs: StageState, progress_every: int, outputs: frozenset[str]
    ) -> AsyncIterator[stage_pb2.StepProgress | StageState]:
        if "latents" not in inputs.tensors:
            raise InvalidArgument("vae-decode needs a 'latents' input tensor")
        unknown = outputs - OUTPUTS
        if unknown:
            raise InvalidArgument(
                f"vae-decode has no output {sorted(unknown)[0][:50]!r}; choose from {sorted(OUTPUTS)}"
            )
        yield await self.compute(self._decode, inputs, outputs or DEFAULT_OUTPUTS)
