"""What flow-matching denoisers share about their latents: the state's latents and scheduler,
the end and NaN checks, checkpoints (latents + step index: flow-matching Euler draws no noise
after the first latents, so that is all another replica needs) and a cheap preview picture."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from omni_common.errors import InvalidArgument
from omni_common.models.base import StageState, StepState
from omni_common.models.capabilities import Branch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` without waiting for the device: a host tensor bound for a GPU goes
    through pinned memory as an asynchronous copy, queued after the work already there. A
    plain `.to()` from pageable memory first waits for all of that work, so a request's
    admission would stall the stage's compute thread behind the running batch's steps (up to
    two of them: the step loop keeps the next one queued)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(kw_only=True)
class LatentState(StepState):
    """A denoising request in flight: its latents and its own (stateful) scheduler."""

    latents: torch.Tensor
    scheduler: FlowMatchEulerDiscreteScheduler  # stateful (its step index): one per request


class LatentSteps:
    """The StepRunner methods every flow-matching denoiser shares; the family's denoiser sets
    `device` and `dtype` and may say in which dtype resumed latents continue."""

    device: torch.device
    dtype: torch.dtype
    # Runs a step's two CFG branches (conditional, unconditional): a replica over several
    # devices runs them on different ones (omni_common.runtime.sequence_parallel). None: both
    # here, the conditional first.
    cfg_branches: Callable[[Branch, Branch], tuple[torch.Tensor, torch.Tensor]] | None = None

    def branches(self, cond: Branch, uncond: Branch) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditional and unconditional predictions of one step."""
        if self.cfg_branches is not None:
            return self.cfg_branches(cond, uncond)
        return cond(), uncond()

    def is_done(self, state: StepState) -> bool:
        return state.step_index >= state.total_steps

    def is_finite(self, state: StepState) -> torch.Tensor:
        """A 0-d bool tensor on the latents' device (read by the scheduler after the step)."""
        assert isinstance(state, LatentState)
        return torch.isfinite(state.latents).all()

    def checkpoint(self, state: StepState) -> StageState:
        """The latents and the step index: the rest (timesteps, sigmas) follows from the
        request and its inputs."""
        assert isinstance(state, LatentState)
        return latent_checkpoint(state.latents, state.step_index)

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        assert isinstance(state, LatentState)
        latents, step_index = read_checkpoint(checkpoint, state.latents.shape, state.total_steps)
        state.latents = latents.to(device=self.device, dtype=self.resumed_dtype(step_index))
        state.step_index = step_index
        state.scheduler.set_begin_index(step_index)

    def resumed_dtype(self, step_index: int) -> torch.dtype:
        """The dtype of the latents after `step_index` steps."""
        return self.dtype


def latent_checkpoint(latents: torch.Tensor, step_index: int) -> StageState:
    return StageState({"latents": latents.clone()}, {"step_index": str(step_index)})


def read_checkpoint(checkpoint: StageState, shape: torch.Size, total_steps: int) -> tuple[torch.Tensor, int]:
    """(latents, step index) of a checkpoint that fits a request with latents of `shape` and
    `total_steps` steps; INVALID_ARGUMENT otherwise."""
    latents = checkpoint.tensors.get("latents")
    try:
        step_index = int(checkpoint.meta.get("step_index", ""))
    except ValueError:
        raise InvalidArgument("the checkpoint has no valid step_index") from None
    if latents is None or latents.shape != shape:
        raise InvalidArgument("the checkpoint's latents do not fit this request")
    if not 0 <= step_index <= total_steps:
        raise InvalidArgument(f"the checkpoint's step_index {step_index} is out of range")
    return latents, step_index


def latent_preview(latents: torch.Tensor) -> np.ndarray:
    """Latents [C, h, w] as a small uint8 [h, w, 3] picture: the first three channels as RGB,
    each stretched to 0..255. Cheap; no VAE."""
    latents = latents.float().cpu()
    rgb = latents[[i % latents.shape[0] for i in range(3)]]
    low = rgb.amin(dim=(1, 2), keepdim=True)
    high = rgb.amax(dim=(1, 2), keepdim=True)
    scaled = (rgb - low) / (high - low).clamp_min(1e-6)
    return (scaled.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
