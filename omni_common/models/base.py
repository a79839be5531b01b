"""The contract between a stage's worker and a model family's runners.

A model family is one file per stage (encode, denoise, decode) plus a fixture builder,
registered by name in `omni_common.models.registry`. Workers only see these protocols.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

MODULE_ROLES = ("dit", "encoder", "vae", "resident")


@dataclass(frozen=True)
class ModuleDeclaration:
    """A family's torch modules by role, as dotted paths relative to a stage's runner (e.g.
    "transformer.img_in"). Sleep moves every declared module's weights except those of
    `resident` modules (small ones that must stay on the device); `layers` name module lists
    (transformer blocks) that layerwise offload streams through the device one at a time."""

    roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.roles) - set(MODULE_ROLES)
        if unknown:
            raise ValueError(f"unknown module roles {sorted(unknown)}; roles are {MODULE_ROLES}")


@dataclass(frozen=True)
class GenerationRequest:
    """One image request, already validated (sizes, ranges, finiteness)."""

    prompt: str
    negative_prompt: str = ""
    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 50
    true_cfg_scale: float = 4.0
    seed: int = 0
    max_sequence_length: int = 512

    @property
    def do_true_cfg(self) -> bool:
        """diffusers' rule: CFG needs a scale above 1 and a negative prompt."""
        return self.true_cfg_scale > 1 and self.negative_prompt != ""


@dataclass(frozen=True)
class DenoiserOptions:
    """How a denoiser runs its transformer on its device (the DiT stage's flags)."""

    # Replay each forward as a CUDA graph, captured once per bucket of shapes (CUDA only).
    cuda_graphs: bool = False
    # (width, height) sizes whose graphs are captured at load, for every batch up to max_batch.
    capture_sizes: tuple[tuple[int, int], ...] = ()
    max_batch: int = 8
    # A diffusers attention backend ("_native_cudnn", "_native_flash", ...); "" keeps the default.
    attention_backend: str = ""
    # torch.compile the transformer's repeated blocks.
    compile: bool = False


@dataclass
class StageState:
    """What one stage hands the next: named CPU or device tensors plus string metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class DenoiseState:
    """Per-request state of a step-wise denoiser; families subclass it with their fields."""

    request: GenerationRequest
    step_index: int
    total_steps: int
    extra: dict[str, Any] = field(default_factory=dict)


class EncoderRunner(Protocol):
    """Prompt text -> conditioning tensors."""

    def encode(self, requests: Sequence[GenerationRequest]) -> list[StageState]:
        """One StageState per request (positive and, with CFG, negative embeddings)."""
        ...


class DenoiserRunner(Protocol):
    """Step-wise denoising, so a scheduler can interleave requests between steps."""

    def prepare(self, request: GenerationRequest, inputs: StageState) -> DenoiseState:
        """Initial noise, timesteps and a fresh scheduler for one request."""
        ...

    def batch_key(self, state: DenoiseState) -> Hashable:
        """States with equal keys may share one transformer forward."""
        ...

    def step(self, states: Sequence[DenoiseState]) -> None:
        """Advance every state by one step, in place."""
        ...

    def is_done(self, state: DenoiseState) -> bool: ...

    def is_finite(self, state: DenoiseState) -> bool:
        """False when the state's latents hold NaN or Inf (the request must fail alone)."""
        ...

    def preview(self, state: DenoiseState) -> np.ndarray:
        """A small uint8 [h, w, 3] picture of the current latents, cheap (no VAE)."""
        ...

    def checkpoint(self, state: DenoiseState) -> StageState:
        """What another replica needs to continue `state` (with the same request)."""
        ...

    def restore(self, state: DenoiseState, checkpoint: StageState) -> None:
        """Move a freshly prepared `state` to where `checkpoint` was taken."""
        ...

    def finish(self, state: DenoiseState) -> StageState:
        """The final latents (and their size metadata) for the decoder."""
        ...

    def forget_cuda_graphs(self) -> None:
        """Drop captured CUDA graphs: they hold the weights' device addresses, which a sleep
        frees (later forwards capture them again). Nothing to do without graphs."""
        ...


class DecoderRunner(Protocol):
    """Latents -> images."""

    def decode(self, states: Sequence[StageState]) -> list[torch.Tensor]:
        """One float32 [3, H, W] image in [0, 1] per state (diffusers' output_type="pt")."""
        ...


class ModelFamily(Protocol):
    """A family of models served by omnistage, e.g. "qwenimage"."""

    name: str
    # What sleep/wake and offload move; None makes workers scan runner attributes instead.
    modules: ModuleDeclaration | None

    def validate(self, request: GenerationRequest) -> None:
        """Raise omni_common.errors.InvalidArgument for requests the family cannot serve."""
        ...

    def load_encoder(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> EncoderRunner: ...

    def load_denoiser(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        options: DenoiserOptions | None = None,
    ) -> DenoiserRunner: ...

    def load_decoder(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> DecoderRunner: ...
