"""Qwen-Image (diffusers QwenImagePipeline) split into encode / denoise / decode runners."""

from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser, QwenImageDenoiseState
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.family import QwenImageFamily

__all__ = [
    "QwenImageDecoder",
    "QwenImageDenoiseState",
    "QwenImageDenoiser",
    "QwenImageEncoder",
    "QwenImageFamily",
]
