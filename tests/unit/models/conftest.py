"""Model-family fixtures: the tiny Qwen-Image checkpoint (tests/conftest.py builds it once per
session) loaded both as diffusers' monolithic pipeline and as omnistage's split runners."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import QwenImagePipeline

from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def reference_pipeline(tiny_model: Path) -> Callable[[torch.dtype], QwenImagePipeline]:
    """diffusers' QwenImagePipeline on the tiny model, one per dtype."""
    cache: dict[torch.dtype, QwenImagePipeline] = {}

    def get(dtype: torch.dtype) -> QwenImagePipeline:
        if dtype not in cache:
            pipe = QwenImagePipeline.from_pretrained(tiny_model, dtype=dtype)
            pipe.set_progress_bar_config(disable=True)
            cache[dtype] = pipe
        return cache[dtype]

    return get


@pytest.fixture(scope="session")
def split_runners(tiny_model: Path) -> Callable[[torch.dtype], tuple[Any, Any, Any]]:
    """(encoder, denoiser, decoder) of the Qwen-Image family on the tiny model, per dtype."""
    cache: dict[torch.dtype, tuple[Any, Any, Any]] = {}

    def get(dtype: torch.dtype) -> tuple[Any, Any, Any]:
        if dtype not in cache:
            cache[dtype] = (
                QwenImageEncoder.load(tiny_model, CPU, dtype),
                QwenImageDenoiser.load(tiny_model, CPU, dtype),
                QwenImageDecoder.load(tiny_model, CPU, dtype),
            )
        return cache[dtype]

    return get
