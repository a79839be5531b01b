"""diffusers' monolithic QwenImagePipeline on a model directory, built from the same loaders
the stages use, so real and random-weights directories give the baseline the same weights
as the cluster (QwenImagePipeline.from_pretrained cannot load a random-weights directory)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder


def monolithic_pipeline(model_dir: Path, device: torch.device, dtype: torch.dtype) -> QwenImagePipeline:
    encoder = QwenImageEncoder.load(model_dir, device, dtype)
    denoiser = QwenImageDenoiser.load(model_dir, device, dtype)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(denoiser.scheduler_config),
        vae=QwenImageDecoder.load(model_dir, device, dtype).vae,
        text_encoder=encoder.text_encoder,
        tokenizer=encoder.tokenizer,
        transformer=denoiser.transformer,
    )
    pipe.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]
    return pipe
