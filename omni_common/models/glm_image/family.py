"""The GLM-Image model family (diffusers' GlmImagePipeline): roles, plan, validation, loaders.

Text to image: the AR model *samples* prior image tokens from the prompt (ar-encoder, "prior",
token by token, continuously batched), the glyph encoder embeds the quoted text to render
(ar-encoder, "glyph"), the DiT denoises conditioned on both (dit-denoise, "denoise"), the VAE
decodes (vae-decode, "vae-decode"). Edit mode adds, per condition image, a VAE encode
(vae-decode, "vae-encode") and one DiT forward that writes every layer's keys and values
(dit-denoise, "condition-kv"): a KV cache produced once, read by every denoising step, and,
being a function of the condition images alone, reused by later requests with the same
images (the coordinator's step cache, keyed by their digests).

Light on purpose: the coordinator imports it; the runners' modules load with a stage.
"""

from __future__ import annotations

from pathlib import Path

from omni_common.errors import InvalidArgument
from omni_common.input_media import input_image_name
from omni_common.models.base import (
    GenerationRequest,
    ModelCard,
    Plan,
    PlanStep,
    RoleSpec,
    StageContext,
    StageModel,
)
from omni_common.models.glm_image.grid import AR_PATCH
from omni_common.models.module_layout import ModuleDeclaration, SequenceParallelPlan
from omni_common.models.validation import check_multiple, check_options

# Output sizes, and condition images (whose tokens must fill the DiT's grid), follow the AR
# model's token grid (grid.py).
SIZE_MULTIPLE = AR_PATCH
MAX_IMAGES = 4
DEFAULT_GUIDANCE = 1.5  # the pipeline's guidance_scale

# Paths are relative to the stage models. The DiT's embeddings, projections and final norm
# are small and run every step: they stay on the device; its blocks stream layerwise.
MODULES = ModuleDeclaration(
    roles={
        "encoder": ("vision_language_encoder", "text_encoder"),
        "dit": ("transformer",),
        "vae": ("vae",),
        "resident": tuple(
            f"transformer.{name}"
            for name in (
                "image_projector",
                "glyph_projector",
                "prior_token_embedding",
                "prior_projector",
                "time_condition_embed",
                "norm_out",
                "proj_out",
            )
        ),
    },
    layers=("transformer.transformer_blocks",),
)

ROLES = (
    RoleSpec("prior", "ar-encoder", "steps", "GlmImageForConditionalGeneration: samples prior image tokens"),
    RoleSpec("glyph", "ar-encoder", "batch", "T5 encoder: glyph embeddings of the quoted text"),
    RoleSpec("denoise", "dit-denoise", "steps", "GlmImageTransformer2DModel, flow-matching Euler"),
    RoleSpec("condition-kv", "dit-denoise", "batch", "one DiT forward per condition image, KV written"),
    RoleSpec("vae-decode", "vae-decode", "batch", "AutoencoderKL: latents -> image"),
    RoleSpec("vae-encode", "vae-decode", "batch", "AutoencoderKL: condition images -> latents"),
)
CONDITION_KV = ("condition_kv.k", "condition_kv.v")


class GlmImageFamily:
    """diffusers' GlmImagePipeline split into AR prior, glyph, (edit: VAE encode, condition
    KV), denoise and decode."""

    name = "glm-image"
    card = ModelCard(
        inputs=("text", "image"),
        max_images=MAX_IMAGES,
        outputs=("image",),
        defaults={"true_cfg_scale": DEFAULT_GUIDANCE, "max_sequence_length": 2048},
        size_multiple=SIZE_MULTIPLE,
    )
    roles: tuple[RoleSpec, ...] = ROLES
    modules: ModuleDeclaration | None = MODULES
    parallel: SequenceParallelPlan | None = None  # one device per replica

    def validate(self, request: GenerationRequest) -> None:
        check_options(dict(request.options), self.card.options, self.name)
        if request.negative_prompt:
            raise InvalidArgument(
                f"{self.name} takes no negative prompt: its guidance runs against an empty glyph prompt"
            )
        for side, value in (("width", request.width), ("height", request.height)):
            check_multiple(side, value, SIZE_MULTIPLE)
        if len(request.images) > MAX_IMAGES:
            raise InvalidArgument(
                f"{self.name} takes at most {MAX_IMAGES} input images; got {len(request.images)}"
            )
        for i, image in enumerate(request.images):
            if image.width % SIZE_MULTIPLE or image.height % SIZE_MULTIPLE:
                raise InvalidArgument(
                    f"input image {i} is {image.width}x{image.height}; a condition image's sides must "
                    f"be multiples of {SIZE_MULTIPLE} (its AR tokens must fill the DiT's grid): resize "
                    "or crop it"
                )

    def plan(self, request: GenerationRequest) -> Plan:
        """The pipeline's recipe as role calls; the prior, glyph and (edit) VAE-encode calls do
        not depend on each other and run at the same time."""
        images = tuple(input_image_name(i) for i in range(len(request.images)))
        glyph = (
            ("prompt_embeds", "negative_prompt_embeds") if request.true_cfg_scale > 1 else ("prompt_embeds",)
        )
        condition_tokens = ("prior_token_image_ids", "source_image_grid_thw") if images else ()
        steps = [
            PlanStep(
                "prior",
                "ar-encoder",
                "prior",
                consumes=images,
                produces=("prior_token_ids", *condition_tokens),
                progress="tokens",
            ),
            PlanStep("glyph", "ar-encoder", "glyph", produces=glyph),
        ]
        condition_kv: tuple[str, ...] = ()
        if images:
            latents = tuple(f"condition_latents.{i}" for i in range(len(images)))
            condition_kv = CONDITION_KV
            steps += [
                PlanStep("vae-encode", "vae-decode", "vae-encode", consumes=images, produces=latents),
                PlanStep(
                    "condition-kv",
                    "dit-denoise",
                    "condition-kv",
                    consumes=(*latents, *condition_tokens),
                    produces=condition_kv,
                    # The KV depends on the condition images alone (their tokens and latents are
                    # deterministic functions of them): requests with the same images share it.
                    cache_key=",".join(image.digest for image in request.images),
                ),
            ]
        steps += [
            PlanStep(
                "denoise",
                "dit-denoise",
                "denoise",
                consumes=(*glyph, "prior_token_ids", *condition_kv),
                produces=("latents",),
                progress="steps",
                resumable=True,
            ),
            PlanStep("decode", "vae-decode", "vae-decode", consumes=("latents",), produces=("image",)),
        ]
        return Plan(tuple(steps))

    def load(self, stage: str, model_dir: Path, context: StageContext) -> StageModel:
        from omni_common.models.glm_image.stages import load_stage

        return load_stage(stage, Path(model_dir), context)
