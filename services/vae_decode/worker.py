"""vae-decode worker: latents -> image, as PNG bytes, raw RGB8 pixels and/or the float tensor.

Only the outputs the caller asks for are made: encoding a PNG costs more than moving the
raw pixels on one host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from omni_common.errors import InvalidArgument
from omni_common.imaging import to_png, to_rgb8
from omni_common.models.base import GenerationRequest, StageState
from omni_common.runtime.batching import MicroBatcher
from omni_common.runtime.config import StageConfig
from omni_common.runtime.worker import Progress, StageCall, Worker

OUTPUTS = frozenset({"png", "rgb8", "image"})
DEFAULT_OUTPUTS = frozenset({"png"})


class DecodeWorker(Worker):
    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.runner = self.family.load_decoder(config.model_dir, self.device, self.dtype)
        self.manage_memory(
            self.runner, reload=lambda: self.family.load_decoder(config.model_dir, self.device, self.dtype)
        )
        self.pending_pixels = 0
        self.batcher: MicroBatcher[tuple[StageState, frozenset[str]], StageState] = MicroBatcher(
            self._decode,
            name=self.stage,
            window_s=config.batch_window_ms / 1e3,
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            cost=_pixels,
            max_cost=config.max_batch_pixels,
        )

    def validate(self, request: GenerationRequest) -> None:
        self.family.validate(request)

    async def _decode(self, items: list[tuple[StageState, frozenset[str]]]) -> list[StageState]:
        images = await self.compute(self.runner.decode, [state for state, _ in items])
        return [
            await self.compute(_outputs, image.cpu(), wanted)
            for image, (_, wanted) in zip(images, items, strict=True)
        ]

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        if "latents" not in call.inputs.tensors:
            raise InvalidArgument("vae-decode needs a 'latents' input tensor")
        unknown = call.outputs - OUTPUTS
        if unknown:
            raise InvalidArgument(
                f"vae-decode has no output {sorted(unknown)[0][:50]!r}; choose from {sorted(OUTPUTS)}"
            )
        item = (call.inputs, call.outputs or DEFAULT_OUTPUTS)
        pixels = call.request.width * call.request.height
        self.pending_pixels += pixels
        try:
            yield await self.batcher.submit(item, deadline=call.deadline, label=call.request_id)
        finally:
            self.pending_pixels -= pixels

    def load(self) -> int:
        return self.pending_pixels

    def close(self) -> None:
        self.batcher.close()
        super().close()


def _pixels(item: tuple[StageState, frozenset[str]]) -> int:
    meta = item[0].meta
    return int(meta.get("height", "0")) * int(meta.get("width", "0"))


def _outputs(image: torch.Tensor, wanted: frozenset[str]) -> StageState:
    """The requested encodings of one float [3, H, W] image."""
    tensors: dict[str, torch.Tensor] = {}
    if "image" in wanted:
        tensors["image"] = image
    if wanted & {"png", "rgb8"}:
        pixels = to_rgb8(image)
        if "rgb8" in wanted:
            tensors["rgb8"] = torch.from_numpy(pixels)
        if "png" in wanted:
            tensors["png"] = torch.frombuffer(bytearray(to_png(pixels)), dtype=torch.uint8)
    return StageState(tensors, {"height": str(image.shape[1]), "width": str(image.shape[2])})
