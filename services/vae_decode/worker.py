"""vae-decode worker: latents -> image, returned as PNG bytes and as the raw float tensor."""

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


def to_png(image: torch.Tensor) -> bytes:
    """float [3, H, W] in [0, 1] -> PNG, quantised exactly as diffusers' numpy_to_pil does."""
    pixels = (image.permute(1, 2, 0).float().numpy() * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


class DecodeWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_decoder(config.model_dir, self.device, self.dtype)

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    def _decode(self, inputs: StageState) -> StageState:
        (image,) = self.runner.decode([inputs])
        image = image.cpu()
        png = torch.frombuffer(bytearray(to_png(image)), dtype=torch.uint8)
        return StageState(
            tensors={"png": png, "image": image},
            meta={"height": str(image.shape[1]), "width": str(image.shape[2])},
        )

    async def run(
        self, request: GenerationRequest, inputs: StageState, progress_every: int
    ) -> AsyncIterator[stage_pb2.StepProgress | StageState]:
        if "latents" not in inputs.tensors:
            raise InvalidArgument("vae-decode needs a 'latents' input tensor")
        yield await self.compute(self._decode, inputs)
