"""The chime family: a prompt spoken as a chime, in three role calls, one per stage type:
encode the prompt (ar-encoder), denoise latent frames step by step (dit-denoise), vocode them
(vae-decode) into one waveform tensor, returned whole (the vocoder does not stream).

Light, as base.py asks: the coordinator imports it; the torch model loads with a stage
(`load` imports stages.py only then)."""

from __future__ import annotations

from pathlib import Path

from omni_common.errors import InvalidArgument
from omni_common.models.base import (
    GenerationRequest,
    ModelCard,
    Plan,
    PlanStep,
    RoleSpec,
    StageContext,
    StageModel,
)
from omni_common.models.module_layout import ModuleDeclaration, SequenceParallelPlan
from tests.families.chime.options import OPTIONS

ROLES = (
    RoleSpec("text-encoder", "ar-encoder", "batch", "chime: prompt bytes to embeddings"),
    RoleSpec("denoise", "dit-denoise", "steps", "chime: latent frames by flow matching, a step at a time"),
    RoleSpec("vocoder", "vae-decode", "batch", "chime: latent frames to 16 kHz samples, whole"),
)


class ChimeFamily:
    """A tiny text-to-audio family (tests/families/chime/model.py)."""

    name = "chime"
    card = ModelCard(
        inputs=("text",), outputs=("audio",), options=OPTIONS, defaults={"num_inference_steps": 4}
    )
    roles: tuple[RoleSpec, ...] = ROLES
    # Attribute paths of the stage models (stages.py); each stage has one of them.
    modules: ModuleDeclaration | None = ModuleDeclaration(
        roles={"encoder": ("text_encoder",), "dit": ("denoiser",), "vae": ("vocoder",)}
    )
    parallel: SequenceParallelPlan | None = None

    def validate(self, request: GenerationRequest) -> None:
        if request.negative_prompt:
            raise InvalidArgument(f"{self.name} takes no negative prompt")
        if request.messages:
            raise InvalidArgument(f"{self.name} takes a prompt, not a conversation")

    def plan(self, request: GenerationRequest) -> Plan:
        """encode -> denoise -> vocode; the vocoder's "audio" is the reply."""
        return Plan(
            (
                PlanStep("encode", "ar-encoder", "text-encoder", produces=("prompt_embeds",)),
                PlanStep(
                    "denoise",
                    "dit-denoise",
                    "denoise",
                    consumes=("prompt_embeds",),
                    produces=("latents",),
                    progress="steps",
                ),
                PlanStep("vocode", "vae-decode", "vocoder", consumes=("latents",), produces=("audio",)),
            )
        )

    def load(self, stage: str, model_dir: Path, context: StageContext) -> StageModel:
        from tests.families.chime.stages import load_stage

        return load_stage(stage, Path(model_dir), context)
