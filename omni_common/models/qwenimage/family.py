"""The Qwen-Image model family: request validation and per-stage loaders."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_common.errors import InvalidArgument
from omni_common.models.base import DenoiserOptions, GenerationRequest, ModuleDeclaration
from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import DEFAULT_VAE_SCALE_FACTOR, QwenImageDenoiser
from omni_common.models.qwenimage.encode import TOKENIZER_MAX_LENGTH, QwenImageEncoder

# Qwen-Image's VAE compresses 8x and the DiT packs 2x2 patches (the tiny fixture's VAE
# compresses 4x, so 16 serves it too).
SIZE_MULTIPLE = DEFAULT_VAE_SCALE_FACTOR * 2

# Paths are relative to the stage runners (QwenImageEncoder.text_encoder, ...). The DiT's
# embeddings, norms and projections are small (~80 MB at full size against 40 GB of
# blocks) and run every step: they stay on the device; its 60 blocks stream layerwise.
MODULES = ModuleDeclaration(
    roles={
        "encoder": ("text_encoder",),
        "dit": ("transformer",),
        "vae": ("vae",),
        "resident": tuple(
            f"transformer.{name}"
            for name in (
                "pos_embed",
                "time_text_embed",
                "txt_norm",
                "img_in",
                "txt_in",
                "norm_out",
                "proj_out",
            )
        ),
    },
    layers=("transformer.transformer_blocks",),
)


class QwenImageFamily:
    """diffusers' QwenImagePipeline split into encode / denoise / decode."""

    name = "qwenimage"
    modules: ModuleDeclaration | None = MODULES

    def validate(self, request: GenerationRequest) -> None:
        """What this family adds to omni_common.validation's ranges: the patch grid."""
        for side, value in (("width", request.width), ("height", request.height)):
            if value % SIZE_MULTIPLE:
                raise InvalidArgument(f"{side} is {value}; it must be a multiple of {SIZE_MULTIPLE}")
        if request.max_sequence_length > TOKENIZER_MAX_LENGTH:
            raise InvalidArgument(
                f"max_sequence_length is {request.max_sequence_length}; "
                f"this model allows at most {TOKENIZER_MAX_LENGTH}"
            )

    def load_encoder(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> QwenImageEncoder:
        return QwenImageEncoder.load(Path(model_dir), device, dtype)

    def load_denoiser(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        options: DenoiserOptions | None = None,
    ) -> QwenImageDenoiser:
        return QwenImageDenoiser.load(Path(model_dir), device, dtype, options)

    def load_decoder(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> QwenImageDecoder:
        return QwenImageDecoder.load(Path(model_dir), device, dtype)
