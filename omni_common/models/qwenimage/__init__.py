"""Qwen-Image (diffusers QwenImagePipeline) split into encode / denoise / decode runners.

Only the family (light) is imported here; the runners live in encode.py, denoise.py,
decode.py and prompt_encoder.py and are imported by the stages that load them."""

from omni_common.models.qwenimage.family import QwenImageFamily

__all__ = ["QwenImageFamily"]
