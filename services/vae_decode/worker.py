"""vae-decode worker: a family's VAE roles (decode latents to images, encode condition images
to latents) and its vocoder roles later; an image output is returned as PNG bytes, raw RGB8
pixels and/or the float tensor.

Only the encodings the caller asks for are made: encoding a PNG costs more than moving the
raw pixels on one host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import torch

from omni_common.errors import FailedPrecondition, InvalidArgument, Unimplemented
from omni_common.imaging import to_png, to_rgb8
from omni_common.models.base import StageContext, StageState
from omni_common.runtime.calls import Progress, StageCall
from omni_common.runtime.config import VAE_BATCH_PIXELS
from omni_common.runtime.hot_reload import WeightsLoaded
from omni_common.runtime.memory import Transition
from omni_common.runtime.roles import RoleLimits
from omni_common.runtime.worker import Worker

IMAGE_OUTPUTS = frozenset({"png", "rgb8", "image"})
DEFAULT_IMAGE_OUTPUTS = frozenset({"png"})


class DecodeWorker(Worker):
    def stage_context(self) -> StageContext:
        config = self.config
        return replace(
            super().stage_context(),
            compile=self.compile_flag(),
            cuda_graphs=self.execution_flag("--cuda-graphs", config.cuda_graphs),
            capture_sizes=config.capture_sizes,
            decode_devices=tuple(torch.device(device) for device in config.devices),
            split_decode_pixels=config.split_decode_pixels,
        )

    async def sleep(self, level: int) -> Transition:
        if self.config.devices:  # the other devices' copies would stay: not built
            raise FailedPrecondition(f"{self.stage} over several devices does not sleep")
        return await super().sleep(level)

    async def load_weights(self, paths: Sequence[str]) -> WeightsLoaded:
        if self.config.devices:
            raise Unimplemented(
                f"LoadWeights is not available on a {self.stage} replica over several devices"
            )
        return await super().load_weights(paths)

    def role_limits(self) -> RoleLimits:
        pixels = self.config.max_batch_pixels
        if pixels < 0:
            pixels = VAE_BATCH_PIXELS["cuda" if self.device.type == "cuda" else "cpu"]
        return replace(super().role_limits(), max_batch_cost=pixels)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        async for item in super().run(call):
            if isinstance(item, StageState) and "image" in item.tensors:
                item = await self.compute(_encoded, item, _image_outputs(call.outputs))
            yield item


def _image_outputs(wanted: frozenset[str]) -> frozenset[str]:
    unknown = wanted - IMAGE_OUTPUTS
    if unknown:
        raise InvalidArgument(
            f"vae-decode has no output {sorted(unknown)[0][:50]!r}; choose from {sorted(IMAGE_OUTPUTS)}"
        )
    return wanted or DEFAULT_IMAGE_OUTPUTS


def _encoded(state: StageState, wanted: frozenset[str]) -> StageState:
    """The requested encodings of a state's float [3, H, W] image (on the device)."""
    image = state.tensors["image"]
    tensors: dict[str, torch.Tensor] = {}
    if "image" in wanted:
        tensors["image"] = image.cpu()
    if wanted & {"png", "rgb8"}:
        pixels = to_rgb8(image)
        if "rgb8" in wanted:
            tensors["rgb8"] = torch.from_numpy(pixels)
        if "png" in wanted:
            tensors["png"] = torch.frombuffer(bytearray(to_png(pixels)), dtype=torch.uint8)
    meta = {**state.meta, "height": str(image.shape[1]), "width": str(image.shape[2])}
    return StageState(tensors, meta)
