"""What each GLM-Image stage replica loads: the models of the roles it serves, as one stage
model whose attribute names are the module paths family.MODULES declares."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import nn

from omni_common.models.base import Runner, StageContext, StageModel


class GlmImageArStage:
    """ar-encoder: the AR prior generator and/or the glyph encoder, each loaded only when the
    replica serves its role (`--roles prior` scales the 9 B AR apart from the small T5)."""

    def __init__(self, model_dir: Path, context: StageContext) -> None:
        from omni_common.models.glm_image.glyph import GlmImageGlyphEncoder
        from omni_common.models.glm_image.prior import GlmImagePrior

        if context.backend != "torch":
            raise SystemExit(
                "ar-encoder: vLLM 0.32 does not serve GLM-Image's AR model "
                "(GlmImageForConditionalGeneration); use --backend torch"
            )
        self._runners: dict[str, Runner] = {}
        self.vision_language_encoder: nn.Module | None = None
        self.text_encoder: nn.Module | None = None
        if context.wants("prior"):
            # Every admitted request holds a KV slot until it finishes (the scheduler steps
            # max_batch of them at a time): rows grow on demand up to the queue bound.
            prior = GlmImagePrior.load(
                model_dir,
                context.device,
                context.dtype,
                max_slots=context.max_queue,
                decode=context.ar_decode,
            )
            self.vision_language_encoder = prior.model
            self._runners["prior"] = prior
        if context.wants("glyph"):
            glyph = GlmImageGlyphEncoder.load(model_dir, context.device, context.dtype)
            self.text_encoder = glyph.text_encoder
            self._runners["glyph"] = glyph

    @property
    def runners(self) -> Mapping[str, Runner]:
        return self._runners


def load_stage(stage: str, model_dir: Path, context: StageContext) -> StageModel:
    if stage == "ar-encoder":
        return GlmImageArStage(model_dir, context)
    if stage == "dit-denoise":
        from omni_common.models.glm_image.denoise import GlmImageDenoiser

        return GlmImageDenoiser.load(model_dir, context.device, context.dtype, context.denoiser)
    from omni_common.models.glm_image.vae import GlmImageVae

    return GlmImageVae.load(model_dir, context.device, context.dtype)
