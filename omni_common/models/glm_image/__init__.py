"""GLM-Image (diffusers GlmImagePipeline) split into AR prior, glyph, VAE encode, condition KV,
denoise and decode runners. Only the family (light) is imported here."""

from omni_common.models.glm_image.family import GlmImageFamily

__all__ = ["GlmImageFamily"]
