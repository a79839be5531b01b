"""What each chime stage replica loads: its piece of the model, under the attribute name the
family's module declaration gives, and the runner of its role."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from omni_common.models.base import (
    GenerationRequest,
    RoleCall,
    Runner,
    StageContext,
    StageModel,
    StageState,
    StepState,
)
from tests.families.chime.model import (
    SAMPLE_RATE,
    ChimeModel,
    encode,
    euler_step,
    noise,
    timesteps,
    vocode,
)
from tests.families.chime.options import frames_of


class ChimeEncoder:
    """text-encoder (BatchRunner): the prompt's embeddings [L, WIDTH]."""

    def __init__(self, text_encoder: nn.Module, device: torch.device) -> None:
        self.text_encoder, self.device = text_encoder, device

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        return [
            StageState({"prompt_embeds": encode(self.text_encoder, call.request.prompt, self.device)})
            for call in calls
        ]

    def cost(self, call: RoleCall) -> int:
        return 1


@dataclass(kw_only=True, eq=False)
class ChimeState(StepState):
    latents: torch.Tensor  # [frames, WIDTH]
    condition: torch.Tensor  # [1, WIDTH]: the mean prompt embedding
    times: list[float]  # total_steps + 1 points from 1 to 0


class ChimeDenoiser:
    """denoise (StepRunner): one Euler step a call, each state on its own (a state's numbers do
    not depend on its batch mates); no checkpoints (a replica that takes over starts again)."""

    def __init__(self, denoiser: nn.Module, device: torch.device) -> None:
        self.denoiser, self.device = denoiser, device

    def prepare(self, request: GenerationRequest, inputs: StageState) -> StepState:
        embeds = inputs.tensors["prompt_embeds"].to(self.device, torch.float32)
        frames = frames_of(request)
        return ChimeState(
            request=request,
            step_index=0,
            total_steps=request.num_inference_steps,
            latents=noise(frames, request.seed).to(self.device),
            condition=embeds.mean(0, keepdim=True),
            times=timesteps(request.num_inference_steps).tolist(),
        )

    def batch_key(self, state: StepState) -> Hashable:
        return 0

    def step_cost(self, state: StepState) -> int:
        return 1

    def step(self, states: Sequence[StepState]) -> None:
        for state in states:
            assert isinstance(state, ChimeState)
            t, t_next = state.times[state.step_index], state.times[state.step_index + 1]
            state.latents = euler_step(self.denoiser, state.latents, state.condition, t, t_next)
            state.step_index += 1

    def is_done(self, state: StepState) -> bool:
        return state.step_index >= state.total_steps

    def is_finite(self, state: StepState) -> bool | torch.Tensor:
        assert isinstance(state, ChimeState)
        return torch.isfinite(state.latents).all()

    def preview(self, state: StepState) -> np.ndarray | None:
        return None

    def checkpoint(self, state: StepState) -> StageState | None:
        return None

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        raise NotImplementedError("chime's denoiser takes no checkpoints")

    def finish(self, state: StepState) -> StageState:
        assert isinstance(state, ChimeState)
        return StageState({"latents": state.latents})

    def release(self, state: StepState) -> None:
        pass


class ChimeVocoder:
    """vocoder (BatchRunner): the whole waveform as one "audio" tensor, with its sample rate."""

    def __init__(self, vocoder: nn.Module, device: torch.device) -> None:
        self.vocoder, self.device = vocoder, device

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        return [
            StageState(
                {"audio": vocode(self.vocoder, call.inputs.tensors["latents"].to(self.device))},
                {"sample_rate": str(SAMPLE_RATE)},
            )
            for call in calls
        ]

    def cost(self, call: RoleCall) -> int:
        return int(call.inputs.tensors["latents"].shape[0])


class ChimeStage:
    """One replica's piece of the model: text_encoder, denoiser or vocoder, by its stage."""

    def __init__(self, stage: str, model_dir: Path, context: StageContext) -> None:
        model = ChimeModel.load(model_dir, context.device)  # float32 on every stage
        self.text_encoder: nn.Module | None = None
        self.denoiser: nn.Module | None = None
        self.vocoder: nn.Module | None = None
        self._runners: dict[str, Runner] = {}
        if stage == "ar-encoder":
            self.text_encoder = model.text_encoder
            self._runners["text-encoder"] = ChimeEncoder(model.text_encoder, context.device)
        elif stage == "dit-denoise":
            self.denoiser = model.denoiser
            self._runners["denoise"] = ChimeDenoiser(model.denoiser, context.device)
        else:
            self.vocoder = model.vocoder
            self._runners["vocoder"] = ChimeVocoder(model.vocoder, context.device)

    @property
    def runners(self) -> Mapping[str, Runner]:
        return self._runners


def load_stage(stage: str, model_dir: Path, context: StageContext) -> StageModel:
    return ChimeStage(stage, model_dir, context)
