"""The Qwen-Image model family: its roles, its plan (encode -> denoise -> decode), request
validation and per-stage loaders. Light on purpose: the coordinator imports it; the runners'
modules (torch models) are imported only when a stage loads them."""

from __future__ import annotations

from pathlib import Path

from omni_common.errors import InvalidArgument
from omni_common.models.base import (
    GenerationRequest,
    ModelCard,
    OptionSpec,
    Plan,
    PlanStep,
    RoleSpec,
    StageContext,
    StageModel,
)
from omni_common.models.module_layout import ModuleDeclaration, SequenceParallelPlan
from omni_common.models.qwenimage.prompt_template import TOKENIZER_MAX_LENGTH
from omni_common.models.validation import check_multiple, check_options

# Qwen-Image's VAE compresses 8x and the DiT packs 2x2 patches (the tiny fixture's VAE
# compresses 4x, so 16 serves it too).
SIZE_MULTIPLE = 16

# Paths are relative to the stage models (QwenImageEncoder.text_encoder, ...). The DiT's
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

# How the DiT splits over the devices of one replica (--devices): its image tokens split across
# the ranks, its text tokens replicated (a prompt of any length, masks unchanged); the joint
# attention exchanges heads for tokens (Ulysses): in its own processor, which starts the exchange
# while it projects (ulysses.py), or around diffusers' attention call where that processor cannot
# take the layers (FP8).
PARALLEL = SequenceParallelPlan(
    module="transformer",
    tokens="hidden_states",
    text="encoder_hidden_states",
    rotary="pos_embed",
    rotary_output=0,
    attention="diffusers.models.transformers.transformer_qwenimage:dispatch_attention_fn",
    heads="num_attention_heads",
    overlapped="omni_common.models.qwenimage.ulysses:install",
)

OPTIONS = (
    OptionSpec(
        "step_cache",
        "float",
        "0",
        0,
        1,
        "first-block cache threshold: 0 off; ~0.05-0.15 reuses the transformer's later blocks on "
        "steps where the first block's residual changed by less than this (faster, not exact)",
    ),
)

ROLES = (
    RoleSpec("text-encoder", "ar-encoder", "async", "Qwen2.5-VL's LM: prompt -> hidden states (cached)"),
    RoleSpec("denoise", "dit-denoise", "steps", "QwenImageTransformer2DModel, flow-matching Euler"),
    RoleSpec("vae-decode", "vae-decode", "batch", "AutoencoderKLQwenImage: packed latents -> image"),
)


class QwenImageFamily:
    """diffusers' QwenImagePipeline split into encode / denoise / decode."""

    name = "qwenimage"
    card = ModelCard(
        inputs=("text",),
        outputs=("image",),
        options=OPTIONS,
        size_multiple=SIZE_MULTIPLE,
        loras=True,
        quantizations=("fp8",),
        dit_cuda_graphs=True,
    )
    roles: tuple[RoleSpec, ...] = ROLES
    modules: ModuleDeclaration | None = MODULES
    parallel: SequenceParallelPlan | None = PARALLEL

    def validate(self, request: GenerationRequest) -> None:
        """What this family adds to omni_common.models.validation's ranges: the patch grid, no images."""
        if request.images:
            raise InvalidArgument(f"{self.name} models take no input images (text to image only)")
        check_options(dict(request.options), self.card.options, self.name)
        for side, value in (("width", request.width), ("height", request.height)):
            check_multiple(side, value, SIZE_MULTIPLE)
        if request.max_sequence_length > TOKENIZER_MAX_LENGTH:
            raise InvalidArgument(
                f"max_sequence_length is {request.max_sequence_length}; "
                f"this model allows at most {TOKENIZER_MAX_LENGTH}"
            )

    def plan(self, request: GenerationRequest) -> Plan:
        """The pipeline's recipe: encode the prompt (and the negative one with true CFG),
        denoise step by step, decode the latents."""
        embeds = ("prompt_embeds", "negative_prompt_embeds") if request.do_true_cfg else ("prompt_embeds",)
        return Plan(
            (
                PlanStep("encode", "ar-encoder", "text-encoder", produces=embeds),
                PlanStep(
                    "denoise",
                    "dit-denoise",
                    "denoise",
                    consumes=embeds,
                    produces=("latents",),
                    progress="steps",
                    resumable=True,
                ),
                PlanStep("decode", "vae-decode", "vae-decode", consumes=("latents",), produces=("image",)),
            )
        )

    def load(self, stage: str, model_dir: Path, context: StageContext) -> StageModel:
        if stage == "ar-encoder":
            from omni_common.models.qwenimage.prompt_encoder import load_prompt_stage

            return load_prompt_stage(Path(model_dir), context)
        if stage == "dit-denoise":
            from omni_common.models.qwenimage.denoise import QwenImageDenoiser

            return QwenImageDenoiser.load(Path(model_dir), context.device, context.dtype, context.denoiser)
        from omni_common.models.qwenimage.decode import QwenImageDecoder

        sizes = context.capture_sizes if context.compile else ()
        decoder = QwenImageDecoder.load(Path(model_dir), context.device, context.dtype, sizes)
        if context.decode_devices:
            decoder.split_over(context.decode_devices, context.split_decode_pixels)
        return decoder
