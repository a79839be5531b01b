"""Qwen-Image decode stage: packed latents -> images, as the end of `QwenImagePipeline.__call__`.

Over several devices (vae-decode's --devices), an image of at least `split_pixels` is decoded
in horizontal bands, one a device at once, each band with BLEND_PIXELS more rows than its
share, blended into the next as diffusers' tiled decode blends its tiles: the image is bit for
bit `vae.decode` with tiling on, one tile a band (`band_tiling` gives diffusers' settings for
it). Smaller images, and those no band would cut, decode whole on the first device.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from torch import nn

from omni_common.errors import InvalidArgument
from omni_common.execution.compile_cache import decisions_for
from omni_common.execution.cuda_graphs import KEEP_IF_FASTER
from omni_common.models.base import RoleCall, StageState
from omni_common.models.weights import load_component

log = logging.getLogger("omnistage.decode")
BLEND_PIXELS = 64  # rows of a band that blend into the next one's (diffusers' tiles overlap as much)


def band_tiling(height: int, width: int, bands: int, scale: int) -> dict[str, int]:
    """`vae.enable_tiling`'s settings that cut a `height` x `width` image into `bands` horizontal
    bands, one tile each (their latent rows: multiples of the VAE's `scale`)."""
    stride = math.ceil(height // scale / bands) * scale
    return {
        "tile_sample_min_height": stride + BLEND_PIXELS,
        "tile_sample_stride_height": stride,
        "tile_sample_min_width": width,
        "tile_sample_stride_width": width,
    }


class QwenImageDecoder:
    """AutoencoderKLQwenImage; one image per state, float32 [3, H, W] in [0, 1]. The
    vae-decode stage model, and its "vae-decode" role (a BatchRunner)."""

    def __init__(self, vae: AutoencoderKLQwenImage, device: torch.device) -> None:
        self.vae = vae
        self.device = device
        self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
        # Latents are packed in 2x2 patches, so sizes are multiples of twice the VAE factor.
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.runners = {"vae-decode": self}
        # vae.decode compiled, and the latent shapes it runs (compile()); others run eagerly.
        self._compiled: Callable[..., Any] | None = None
        self._compiled_shapes: set[tuple[int, ...]] = set()
        self._loading: threading.Thread | None = None  # compile()'s background loads
        # Over several devices (split_over): the VAE on each other one, and a thread a device.
        self._band_vaes: list[AutoencoderKLQwenImage] = []
        self._bands: ThreadPoolExecutor | None = None
        self.split_pixels = 0

    def split_over(self, devices: Sequence[torch.device], pixels: int) -> None:
        """Decode images of at least `pixels` in bands over `devices` (the first is this one's)."""
        if list(devices[:1]) != [self.device]:
            raise ValueError(f"the first device of a split decode is the decoder's, {self.device}")
        self._band_vaes = [nn.Module.to(copy.deepcopy(self.vae), device) for device in devices[1:]]
        self._bands = ThreadPoolExecutor(len(devices), thread_name_prefix="vae-band")
        self.split_pixels = pixels

    def close(self) -> None:
        if self._bands is not None:
            self._bands.shutdown()

    def compile(self, sizes: Sequence[tuple[int, int]]) -> None:
        """Compile vae.decode for one image at each (width, height) of `sizes`, and keep it
        for the sizes where it beats the eager decode, timed here (an H200 at 1024x1024:
        52 ms against 67; at 512x512 the eager decode has been as fast). A batch of a
        compiled size decodes image by image; other sizes run eagerly: compiling one would
        stall its request for seconds.
        With a compile cache, a restart reuses the first start's decisions: it times nothing,
        and loads the sizes that paid in the background while the stage serves eagerly (on
        an H200, loading two sizes made vae-decode the last stage of a warm cluster to be
        ready, 3.6 s after the DiT); `wait_compiled` waits for them."""
        compiled = torch.compile(self.vae.decode, dynamic=False)
        self._compiled = compiled
        decisions = decisions_for("vae-compile", self.device, dict(self.vae.config))
        to_load: list[tuple[tuple[int, int], torch.Tensor]] = []
        for width, height in sizes:
            with torch.inference_mode():  # made as requests' latents are: no recompile for them
                latents = self._latent_zeros(width, height)
            speedup = decisions.get((width, height)) if decisions is not None else None
            if speedup is not None:
                kept = speedup * KEEP_IF_FASTER >= 1
                if kept:
                    to_load.append(((width, height), latents))
                verdict = "compiled, loading while the stage serves" if kept else "eager"
                timed = f"{speedup:.2f}x eager when first timed"
                log.info("vae-decode at %dx%d: %s: %s", width, height, timed, verdict)
                continue
            try:
                best = _decode_ms({"eager": self.vae.decode, "compiled": compiled}, latents)
            except Exception as err:  # an op the compiler cannot take: the VAE stays eager
                log.warning("vae-decode: cannot compile the decode at %dx%d (%s); eager", width, height, err)
                continue
            eager_ms, compiled_ms = best["eager"], best["compiled"]
            speedup = eager_ms / compiled_ms
            if decisions is not None:
                decisions.put((width, height), speedup)
            kept = speedup * KEEP_IF_FASTER >= 1
            if kept:
                self._compiled_shapes.add(tuple(latents.shape))
            timed = f"compiled {compiled_ms:.1f} ms, eager {eager_ms:.1f} ms"
            log.info("vae-decode at %dx%d: %s: %s", width, height, timed, "compiled" if kept else "eager")
        if to_load:
            self._loading = threading.Thread(
                target=self._load_compiled, args=(to_load,), name="vae-compile-load", daemon=True
            )
            self._loading.start()

    def _load_compiled(self, to_load: list[tuple[tuple[int, int], torch.Tensor]]) -> None:
        """Compile (load from the cache) the decode at each of `to_load`'s sizes, then let
        requests take them all at once: no request calls the compiled decode while another
        of its sizes compiles (torch.compile is not made for that)."""
        compiled = self._compiled
        assert compiled is not None
        started = time.perf_counter()
        loaded = []
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for (width, height), latents in to_load:
                try:
                    _decode_ms({"compiled": compiled}, latents, runs=0)
                except Exception as err:  # the cache no longer fits: this size stays eager
                    log.warning("vae-decode: cannot load the decode at %dx%d (%s); eager", width, height, err)
                    continue
                loaded.append(tuple(latents.shape))
        self._compiled_shapes.update(loaded)
        log.info("vae-decode: %d compiled sizes loaded in %.1f s", len(loaded), time.perf_counter() - started)

    def wait_compiled(self, timeout: float | None = None) -> None:
        """Wait until the compiled sizes that load in the background (compile) are in use."""
        if self._loading is not None:
            self._loading.join(timeout)

    def _latent_zeros(self, width: int, height: int) -> torch.Tensor:
        """vae.decode's input for one image of `width` x `height`."""
        patch = self.vae_scale_factor * 2
        shape = (1, self.vae.config["z_dim"], 1, height // patch * 2, width // patch * 2)
        return torch.zeros(shape, device=self.device, dtype=self.vae.dtype)

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        """Per call {"image": float32 [3, H, W]} with meta height/width."""
        images = self.decode([call.inputs for call in calls])
        return [
            StageState({"image": image}, {"height": str(image.shape[1]), "width": str(image.shape[2])})
            for image in images
        ]

    def cost(self, call: RoleCall) -> int:
        """Pixels: the batch budget (--max-batch-pixels) keeps activations in the caches."""
        return call.request.width * call.request.height

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        compile_sizes: Sequence[tuple[int, int]] = (),
    ) -> QwenImageDecoder:
        """Load vae/ of a diffusers Qwen-Image directory; compile its decode at
        `compile_sizes` (width, height), where that pays."""
        decoder = cls(load_component(AutoencoderKLQwenImage, model_dir / "vae", device, dtype), device)
        if compile_sizes:
            decoder.compile(compile_sizes)
        return decoder

    def decode(self, states: Sequence[StageState]) -> list[torch.Tensor]:
        """States of one size share a vae.decode call; sizes are decoded group by group and
        the images come back in the order of `states`."""
        checked = [self._checked(state) for state in states]
        groups: dict[tuple[int, int], list[int]] = {}
        for index, (_, height, width) in enumerate(checked):
            groups.setdefault((height, width), []).append(index)
        images: list[torch.Tensor | None] = [None] * len(states)
        for (height, width), indices in groups.items():
            latents = torch.cat([checked[i][0] for i in indices])
            for i, image in zip(indices, self._decode_group(latents, height, width), strict=True):
                images[i] = image
        return [image for image in images if image is not None]

    def _checked(self, state: StageState) -> tuple[torch.Tensor, int, int]:
        """(packed latents [1, seq, C] on the device, height, width) of a valid state."""
        try:
            latents = state.tensors["latents"].to(self.device)
            height, width = int(state.meta["height"]), int(state.meta["width"])
        except (KeyError, ValueError) as exc:
            raise InvalidArgument("decode input needs 'latents' and height/width meta") from exc
        patch = self.vae_scale_factor * 2
        expected = (height // patch) * (width // patch)
        if latents.dim() != 3 or latents.shape[0] != 1 or latents.shape[1] != expected:
            raise InvalidArgument(
                f"latents of shape {tuple(latents.shape)} do not fit a {width}x{height} image"
            )
        return latents, height, width

    @torch.inference_mode()
    def _decode_group(self, latents: torch.Tensor, height: int, width: int) -> list[torch.Tensor]:
        """Packed latents [N, seq, C] of one size -> N images, as the pipeline decodes a batch."""
        config = self.vae.config
        latents = QwenImagePipeline._unpack_latents(latents, height, width, self.vae_scale_factor)
        latents = latents.to(self.vae.dtype)
        z_dim = config["z_dim"]
        latents_mean = (
            torch.tensor(config["latents_mean"]).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        )
        latents_std = 1.0 / torch.tensor(config["latents_std"]).view(1, z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        latents = latents / latents_std + latents_mean
        if self._bands is not None and height * width >= self.split_pixels and self._bands_cut(height):
            frames = torch.cat([self._decode_in_bands(one) for one in latents.split(1)])
        elif self._compiled is not None and (1, *latents.shape[1:]) in self._compiled_shapes:
            # Image by image through the code compiled for one: faster than the eager batch
            # (8 at 512x512 on an H200: 109.5 ms against 130.4), nothing new to compile, and
            # each image independent of what it was batched with.
            compiled = self._compiled
            frames = torch.cat([compiled(one, return_dict=False)[0] for one in latents.split(1)])
        else:
            frames = self.vae.decode(latents, return_dict=False)[0]
        image = frames[:, :, 0]
        image = self.image_processor.postprocess(image, output_type="pt")
        return [one.float() for one in image]

    def _bands_cut(self, height: int) -> bool:
        """Whether bands cut an image this high (a first band as high as the image leaves it
        whole, as diffusers' tiled decode does)."""
        tiling = band_tiling(height, 0, len(self._band_vaes) + 1, self.vae_scale_factor)
        return tiling["tile_sample_min_height"] < height

    def _decode_in_bands(self, z: torch.Tensor) -> torch.Tensor:
        """One image's latents [1, C, 1, h, w] -> frames [1, 3, 1, H, W]: its bands decoded at
        once, a device each, then blended on this decoder's device in order (`band_tiling`)."""
        assert self._bands is not None
        vaes = [self.vae, *self._band_vaes]
        scale = self.vae_scale_factor
        height, width = z.shape[-2] * scale, z.shape[-1] * scale
        tiling = band_tiling(height, width, len(vaes), scale)
        rows, stride = tiling["tile_sample_min_height"] // scale, tiling["tile_sample_stride_height"] // scale
        starts = range(0, z.shape[-2], stride)

        def band(vae: AutoencoderKLQwenImage, start: int) -> torch.Tensor:
            device = next(vae.parameters()).device
            with (
                torch.inference_mode(),
                torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(),
            ):
                vae.clear_cache()
                vae._conv_idx = [0]
                tile = vae.post_quant_conv(z[:, :, :1, start : start + rows].to(device))
                decoded = vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx)
                vae.clear_cache()
                return decoded.to(self.device)

        decoded = list(self._bands.map(band, vaes, starts))
        kept = []
        for i, tile in enumerate(decoded):
            if i:
                tile = self.vae.blend_v(decoded[i - 1], tile, BLEND_PIXELS)
            kept.append(tile[:, :, :, : stride * scale])
        return torch.cat(kept, dim=3)[:, :, :, :height, :width]


@torch.inference_mode()
def _decode_ms(
    decodes: dict[str, Callable[..., Any]], latents: torch.Tensor, runs: int = 5
) -> dict[str, float]:
    """The fastest of `runs` decodes of `latents` by each of `decodes`, in ms, after two
    untimed ones (compiling). Their runs take turns, so that whatever else shares the device
    (another stage's warm-up at a cold start) slows each alike."""
    synced = torch.cuda.synchronize if latents.is_cuda else (lambda: None)
    for decode in decodes.values():
        for _ in range(2):
            decode(latents, return_dict=False)
    best = dict.fromkeys(decodes, float("inf"))
    for _ in range(runs):
        for name, decode in decodes.items():
            synced()
            started = time.perf_counter()
            decode(latents, return_dict=False)
            synced()
            best[name] = min(best[name], (time.perf_counter() - started) * 1e3)
    return best
