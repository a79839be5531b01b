"""Qwen2.5-Omni vocoder role: BigVGAN turns mel frames into 24 kHz samples as the frames stream
in from token2wav, batched across requests whose windows have the same length.

BigVGAN is a stack of convolutions: a sample depends on the mel frames around it only (29
frames each side; the outer ones barely), so a window of frames with CONTEXT_FRAMES of context
on each side, trimmed to its middle, gives the middle's samples as the whole mel gives them
(within ~1 ulp; docs/families.md has the measurement). Each mel chunk is vocoded in a window
of its own, whenever it arrives: its left context is the frames before it, its right context
the provisional "lookahead" frames that came with it (token2wav's window beyond the chunk). So
a reply's samples depend on its chunks only, never on how many had arrived when the vocoder
stepped: a reply whose token2wav resumed elsewhere, or whose chunks queued behind other work,
gets the samples of an uninterrupted one. Chunks sent without a lookahead wait for the next
chunk that has one, or for the end, and share its window. A request whose mel comes in one
piece (one-shot mode) is vocoded in one call over all of it: transformers' own computation, so
its samples are `generate`'s.

Chunks (take_partial): "audio" [n] float32 samples, meta "sample_rate", "chunk".
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Qwen2_5OmniToken2WavModel

from omni_common.errors import InvalidArgument, Unimplemented
from omni_common.execution.compile_cache import decisions_for
from omni_common.execution.cuda_graphs import CudaGraphCache
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.qwen_omni.checkpoint import load_config, load_part
from omni_common.models.qwen_omni.options import SAMPLE_RATE

CONTEXT_FRAMES = 24  # each side: within ~1 ulp of the whole mel's samples (docs/families.md)
# (batch, frames) of the windows a streamed reply makes: its first chunk with the lookahead's
# context, every later chunk with context on both sides; a pair batched.
WARM_WINDOWS = ((1, 48), (1, 120), (2, 120))


# transformers' process_mel_spectrogram: log-mel -> decibels floored at MIN_DB, less 20 dB,
# scaled to [-1, 1].
MIN_DB = -115


def mel_floor(device: torch.device) -> torch.Tensor:
    """The amplitude floor of MIN_DB, made as transformers' amplitude_to_db makes it (so the
    samples stay bitwise), once, outside any graph capture: a capture cannot copy it from the
    host."""
    return torch.exp(torch.tensor(MIN_DB / 20.0 * np.log(10), device=device, dtype=torch.float32))


def bigvgan_samples(bigvgan: Any, mel: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2_5OmniToken2WavBigVGANModel.forward, the same operations in the same
    order, with two differences that let a CUDA graph capture it (seen on an H100: the
    vocoder's graphs fell back to eager): its amplitude floor comes made (`mel_floor`), where
    the forward copies it from the host on every call, and the samples stay on the model's
    device, where the forward ends by copying them to the host (`.cpu()`)."""
    decibels = 20 * torch.log10(torch.clamp(torch.exp(mel), min=floor)) - 20
    hidden = bigvgan.conv_pre(bigvgan.normalize_spectrogram(decibels, 1, MIN_DB))
    blocks = bigvgan.num_residual_blocks
    for layer in range(bigvgan.num_upsample_layers):
        hidden = bigvgan.ups[layer][0](hidden)
        hidden = sum(bigvgan.resblocks[layer * blocks + block](hidden) for block in range(blocks)) / blocks
    samples = bigvgan.conv_post(bigvgan.activation_post(hidden))
    return torch.clamp(samples, min=-1.0, max=1.0).squeeze()


@dataclass(kw_only=True, eq=False)
class VocoderState(StepState):
    mel: torch.Tensor  # [mel_dim, frames received] float32
    # The chunks received and not yet vocoded, in order: (the frame after the chunk, the
    # provisional frames that came after it, right context only, or None).
    unmade: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    ended: bool = False
    frames_done: int = 0  # frames whose samples were made
    pending: list[torch.Tensor] = field(default_factory=list)
    chunks_sent: int = 0


class Vocoder:
    """The "vocoder" role (a StreamingRunner). Runs in float32, as transformers runs it.

    With `cuda_graphs` (the vae-decode stage's --cuda-graphs) each BigVGAN call is replayed as a
    CUDA graph, one per batch and window length, captured at its first use (a window of 48-120
    frames is a stack of small convolutions and activations: launch-bound); the windows every
    reply makes (WARM_WINDOWS) are captured while idle. A replay runs the captured kernels, so
    its samples are the eager ones' within float rounding."""

    def __init__(self, bigvgan: Any, device: torch.device, cuda_graphs: bool = False) -> None:
        self.bigvgan = bigvgan
        self.device = device
        self.floor = mel_floor(device)
        self.mel_dim: int = bigvgan.config.mel_dim
        self.hop = math.prod(bigvgan.config.upsample_rates)  # samples per mel frame
        self.graphs: CudaGraphCache | None = None
        if cuda_graphs and device.type == "cuda":
            decisions = decisions_for("vocoder-graphs", device, bigvgan.config.to_dict())
            self.graphs = CudaGraphCache(device, decisions=decisions)
        self._unwarmed = list(WARM_WINDOWS) if self.graphs is not None else []

    @classmethod
    def load(cls, model_dir: Path, device: torch.device, cuda_graphs: bool = False) -> Vocoder:
        config = load_config(model_dir).token2wav_config
        token2wav = load_part(
            Qwen2_5OmniToken2WavModel, config, model_dir, "token2wav", device, torch.float32
        )
        return cls(token2wav.code2wav_bigvgan_model, device, cuda_graphs)

    def prepare(self, request: GenerationRequest, inputs: StageState) -> VocoderState:
        state = VocoderState(
            request=request, step_index=0, total_steps=1, mel=torch.zeros(self.mel_dim, 0, device=self.device)
        )
        self.feed(state, inputs, end=False)
        return state

    def feed(self, state: StepState, chunk: StageState, end: bool) -> None:
        assert isinstance(state, VocoderState)
        mel = chunk.tensors.get("mel")
        if mel is not None:
            if mel.dim() != 2 or mel.shape[0] != self.mel_dim or not mel.is_floating_point():
                raise InvalidArgument(f"a mel chunk must be float [{self.mel_dim}, frames]")
            if int(chunk.meta.get("frame", "-1")) != state.mel.shape[1]:
                raise InvalidArgument("mel chunks must come in order, each once")
            lookahead = chunk.tensors.get("lookahead")
            if lookahead is not None and (lookahead.dim() != 2 or lookahead.shape[0] != self.mel_dim):
                raise InvalidArgument(f"a mel chunk's lookahead must be float [{self.mel_dim}, frames]")
            if mel.shape[1]:
                state.mel = torch.cat([state.mel, mel.to(self.device, torch.float32)], dim=1)
                right = None if lookahead is None else lookahead[:, :CONTEXT_FRAMES].to(state.mel)
                state.unmade.append((state.mel.shape[1], right))
        state.ended = state.ended or end

    def _span(self, state: VocoderState) -> tuple[int, int, int] | None:
        """(window start, first frame made, end of frames made) of the next call: the first
        unmade chunk, with the chunks after it up to the first one that came with a lookahead
        (or, once the stream ended, up to the last one)."""
        upto = next((end for end, right in state.unmade if right is not None), None)
        if upto is None and state.ended and state.mel.shape[1] > state.frames_done:
            upto = state.mel.shape[1]
        return None if upto is None else (max(0, state.frames_done - CONTEXT_FRAMES), state.frames_done, upto)

    def _window(self, state: VocoderState, span: tuple[int, int, int]) -> torch.Tensor:
        """The span's frames, then the right context that came with its last chunk."""
        start, _, upto = span
        right = [right for end, right in state.unmade if end == upto and right is not None]
        return torch.cat([state.mel[:, start:upto], *right], dim=1)

    def ready(self, state: StepState) -> bool:
        assert isinstance(state, VocoderState)
        return self._span(state) is not None or self.is_done(state)

    def batch_key(self, state: StepState) -> Hashable:
        assert isinstance(state, VocoderState)
        span = self._span(state)
        return 0 if span is None else self._window(state, span).shape[1]

    def step_cost(self, state: StepState) -> int:
        return 1

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        live = [
            (s, span) for s in states if isinstance(s, VocoderState) and (span := self._span(s)) is not None
        ]
        if not live:
            return
        audio = self._vocode(torch.stack([self._window(state, span) for state, span in live]))
        for row, (state, (start, first, upto)) in enumerate(live):
            state.pending.append(audio[row, (first - start) * self.hop : (upto - start) * self.hop].clone())
            state.frames_done = upto
            state.unmade = [chunk for chunk in state.unmade if chunk[0] > upto]

    def _vocode(self, mel: torch.Tensor) -> torch.Tensor:
        """[batch, samples] of a batch of mel windows [batch, mel_dim, frames]: replayed as a
        CUDA graph where one is kept, else eager."""

        def vocode(given: dict[str, torch.Tensor]) -> torch.Tensor:
            return bigvgan_samples(self.bigvgan, given["mel"], self.floor).view(given["mel"].shape[0], -1)

        if self.graphs is not None:
            audio = self.graphs.run(tuple(mel.shape), {"mel": mel}, vocode, decision_key="vocode")
            if audio is not None:
                return audio
        return vocode({"mel": mel})  # BigVGAN squeezes a batch of one: the view puts it back

    @torch.no_grad()
    def idle_work(self) -> bool:
        """HasIdleWork: one common window's graph captured on a silent mel, so that a first
        request does not wait for it."""
        if not self._unwarmed:
            return False
        batch, frames = self._unwarmed.pop(0)
        self._vocode(torch.zeros(batch, self.mel_dim, frames, device=self.device))
        return True

    def idle_work_left(self) -> int:
        return len(self._unwarmed)

    def take_partial(self, state: StepState) -> StageState | None:
        assert isinstance(state, VocoderState)
        if not state.pending:
            return None
        samples = torch.cat(state.pending).cpu()  # the chunk's one copy to the host
        state.pending.clear()
        meta = {"chunk": str(state.chunks_sent), "sample_rate": str(SAMPLE_RATE)}
        state.chunks_sent += 1
        return StageState(tensors={"audio": samples}, meta=meta)

    def is_done(self, state: StepState) -> bool:
        assert isinstance(state, VocoderState)
        return state.ended and state.frames_done >= state.mel.shape[1] and not state.pending

    def is_finite(self, state: StepState) -> bool:
        return True  # BigVGAN clamps its output to [-1, 1]

    def preview(self, state: StepState) -> np.ndarray | None:
        return None

    def checkpoint(self, state: StepState) -> StageState | None:
        return None

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        raise Unimplemented("the vocoder does not resume from checkpoints")

    def finish(self, state: StepState) -> StageState:
        assert isinstance(state, VocoderState)
        return StageState(
            tensors={}, meta={"sample_rate": str(SAMPLE_RATE), "samples": str(state.frames_done * self.hop)}
        )

    def release(self, state: StepState) -> None:
        pass

    def forget_cuda_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
            self._unwarmed = list(WARM_WINDOWS)
