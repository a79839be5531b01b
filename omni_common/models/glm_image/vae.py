"""GLM-Image VAE: condition images -> normalized latents, and final latents -> images.

Reads like the two VAE passages of `GlmImagePipeline.__call__` in diffusers 0.42.1: step 4
and 6 (each condition image resized to a multiple of the latent patch, encoded to the mode of
its latent distribution, normalized with the VAE's latents_mean/std) and the end (latents
de-normalized, decoded, mapped to [0, 1]). One loaded AutoencoderKL serves both roles.

Every image goes through the VAE alone (a batch of one), as in the pipeline for a single
request: an image must not depend on what else was in its batch, and batching changes the
bits (tiny fixture, CPU fp32: three latents decoded together differ from one by one by up to
1e-5, encoded by up to 1e-6). At real sizes one image already fills a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.pipelines.glm_image.pipeline_glm_image import retrieve_latents

from omni_common.errors import InvalidArgument
from omni_common.imaging import decode_image, input_image_bytes
from omni_common.models.base import BatchRunner, GenerationRequest, RoleCall, StageState
from omni_common.models.weights import load_component

DEFAULT_VAE_SCALE_FACTOR = 8
DEFAULT_PATCH_SIZE = 2


def _config(model_dir: Path, component: str) -> dict[str, object]:
    path = model_dir / component / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def vae_scale_factor_for(model_dir: Path) -> int:
    """The VAE's spatial compression, 2 ** (number of blocks - 1) as the pipeline computes it,
    from vae/config.json only (a stage without the VAE still needs it); 8 without one."""
    blocks = _config(model_dir, "vae").get("block_out_channels")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list) else DEFAULT_VAE_SCALE_FACTOR


def patch_size_for(model_dir: Path) -> int:
    """The DiT's latent patch size, from transformer/config.json only; 2 without one."""
    patch = _config(model_dir, "transformer").get("patch_size")
    return patch if isinstance(patch, int) else DEFAULT_PATCH_SIZE


class GlmImageVae:
    """AutoencoderKL in the stage's dtype; `encoder_runner()` and `decoder_runner()` are its
    two roles."""

    def __init__(
        self,
        vae: AutoencoderKL,
        device: torch.device,
        dtype: torch.dtype,
        patch_size: int = DEFAULT_PATCH_SIZE,
    ) -> None:
        self.vae = vae
        self.device = device
        self.dtype = dtype
        config = vae.config
        self.vae_scale_factor = 2 ** (len(config["block_out_channels"]) - 1)
        # Condition images are cut down to whole DiT patches of latents.
        self.image_multiple = self.vae_scale_factor * patch_size
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)
        shape = (1, config["latent_channels"], 1, 1)
        self.latents_mean = torch.tensor(config["latents_mean"]).view(shape)
        self.latents_std = torch.tensor(config["latents_std"]).view(shape)
        self.runners: dict[str, BatchRunner] = {
            "vae-encode": self.encoder_runner(),
            "vae-decode": self.decoder_runner(),
        }

    @classmethod
    def load(cls, model_dir: Path, device: torch.device, dtype: torch.dtype) -> GlmImageVae:
        """Load vae/ of a diffusers GLM-Image directory (and the DiT's patch size)."""
        vae = load_component(AutoencoderKL, model_dir / "vae", device, dtype)
        return cls(vae, device, dtype, patch_size_for(model_dir))

    def encoder_runner(self) -> GlmImageVaeEncoder:
        return GlmImageVaeEncoder(self)

    def decoder_runner(self) -> GlmImageVaeDecoder:
        return GlmImageVaeDecoder(self)

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) a condition image is resized to: floored to whole latent patches."""
        multiple = self.image_multiple
        return (width // multiple) * multiple, (height // multiple) * multiple

    @torch.inference_mode()
    def encode_image(self, data: torch.Tensor, index: int = 0) -> torch.Tensor:
        """Input image `index` (its file bytes, uint8) -> normalized latents [1, C, h, w] in the
        stage dtype."""
        image = decode_image(data.cpu(), index=index)
        width, height = self.condition_size(*image.size)
        if width == 0 or height == 0:
            raise InvalidArgument(
                f"input image {index} is {image.size[0]}x{image.size[1]}; each side needs at least "
                f"{self.image_multiple} pixels"
            )
        pixels = self.image_processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        latents = retrieve_latents(self.vae.encode(pixels), sample_mode="argmax")
        mean = self.latents_mean.to(device=self.device, dtype=self.dtype)
        std = self.latents_std.to(device=self.device, dtype=self.dtype)
        return (latents - mean) / std

    @torch.inference_mode()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents [1, C, h, w] -> float32 [3, H, W] in [0, 1] (the pipeline's "pt" output)."""
        latents = latents.to(device=self.device, dtype=self.vae.dtype)
        mean = self.latents_mean.to(latents.device, latents.dtype)
        std = self.latents_std.to(latents.device, latents.dtype)
        # The pipeline hands vae.decode its generator; AutoencoderKL.decode ignores it.
        image = self.vae.decode(latents * std + mean, return_dict=False)[0]
        return self.image_processor.postprocess(image, output_type="pt")[0].float()

    def checked_latents(self, state: StageState) -> tuple[torch.Tensor, int, int]:
        """(latents, height, width) of a decode input, or InvalidArgument."""
        latents = state.tensors.get("latents")
        try:
            height, width = int(state.meta["height"]), int(state.meta["width"])
        except (KeyError, ValueError):
            raise InvalidArgument("vae-decode input needs height and width meta (pixels)") from None
        if latents is None:
            raise InvalidArgument("vae-decode input lacks the tensor 'latents'")
        factor = self.vae_scale_factor
        expected = (1, self.vae.config["latent_channels"], height // factor, width // factor)
        if tuple(latents.shape) != expected or height % factor or width % factor:
            raise InvalidArgument(
                f"latents of shape {tuple(latents.shape)} do not fit a {width}x{height} image "
                f"(expected {expected})"
            )
        return latents, height, width


class GlmImageVaeEncoder:
    """Role "vae-encode" (BatchRunner): the request's input images -> "condition_latents.{i}"."""

    def __init__(self, vae: GlmImageVae) -> None:
        self.vae = vae

    def cost(self, call: RoleCall) -> int:
        return sum(image.width * image.height for image in call.request.images)

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        return [self._run(call) for call in calls]

    def _run(self, call: RoleCall) -> StageState:
        tensors = {}
        for index in range(len(call.request.images)):
            data = input_image_bytes(call.inputs.tensors, index)
            tensors[condition_latents_name(index)] = self.vae.encode_image(data, index)
        if not tensors:
            raise InvalidArgument("vae-encode got a request without input images")
        return StageState(tensors)


class GlmImageVaeDecoder:
    """Role "vae-decode" (BatchRunner): "latents" + height/width meta -> "image" float32
    [3, H, W] in [0, 1], with the same meta."""

    def __init__(self, vae: GlmImageVae) -> None:
        self.vae = vae

    def cost(self, call: RoleCall) -> int:
        request: GenerationRequest = call.request
        return request.width * request.height

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        outputs = []
        for call in calls:
            latents, height, width = self.vae.checked_latents(call.inputs)
            image = self.vae.decode_latents(latents)
            outputs.append(StageState({"image": image}, {"height": str(height), "width": str(width)}))
        return outputs


def condition_latents_name(index: int) -> str:
    """The tensor name of the `index`-th condition image's latents."""
    return f"condition_latents.{index}"
