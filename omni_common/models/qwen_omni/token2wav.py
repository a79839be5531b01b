"""Qwen2.5-Omni token2wav DiT role: mel frames from codec tokens by flow matching, step-wise and
batched across requests like the image DiT.

Reads like `Qwen2_5OmniToken2WavDiTModel.sample`: noise from `torch.randn` (the request's own
generator, seeded with its seed), the time points `linspace(0, 1, steps)` bent by the sway
coefficient, and RK4 over them (`RungeKutta4ODESolver`): one step here is one RK4 interval, four
guided evaluations of the DiT (conditional and unconditional rows in one forward, guidance 0.5),
batched over every request at the same window length. Each request's solver arithmetic runs
alone, in the solver's own order, so a request alone gets the solver's very numbers.

Two modes (option stream_audio):
- **one shot** (0): once the talker has ended, one window over all the codes, exactly `sample`:
  the mel equals transformers' one-shot token2wav;
- **streamed** (1, default): windows of CHUNK_BLOCKS DiT blocks (72 frames = 36 codes = 0.72 s;
  the first window FIRST_BLOCKS, so that audio starts early) as the codes arrive, each solved
  with PAST_BLOCKS blocks of context before it and FUTURE_BLOCKS after, over the same noise the
  one-shot would draw for those frames. These are vllm-omni's sizes, and they match the DiT's
  attention: layers attend one block ahead and two blocks back (`look_ahead_layers`,
  `look_backward_layers`), so one forward of a window computes the chunk's frames exactly. The
  ODE is not: 36 evaluations let context errors creep in (measured in docs/families.md). The
  windows are fixed by the frame count alone, never by timing, so a request's audio is the same
  however fast its codes arrive (a takeover replica makes the same windows), up to the float
  rounding of the rows a product is batched with. The first audio leaves after 24 codes instead
  of after the whole reply.

A window depends on its codes and its noise alone, never on the mel of the one before, so the
windows of one utterance whose codes are here solve together (up to MAX_OPEN, rows of one forward,
each at its own RK4 interval): when the talker is ahead, as it is when token2wav sets the pace,
an interval of several windows costs about what one window's costs (a window's forward is small
and launch-bound on a GPU). A window joins the open ones only at their length (the first two
windows and the last are shorter), and the windows close in the order they opened, so the chunks
leave in order.

Chunks (take_partial): "mel" [mel_dim, n] float32, the chunk's frames, and "lookahead"
[mel_dim, m], the window's frames after them (provisional: the next chunk makes them again; the
vocoder reads them as right context only); meta "frame" (the chunk's first frame), "chunk".

Checkpoints (streamed mode): after each window, the noise drawn that later windows still read
(from PAST_BLOCKS before the next chunk on) and the generator, with the frame and chunk counts.
A replica that takes over is fed the codes again from the start and solves the next window
with the same noise, so the mel it sends equals the uninterrupted one. A one-shot request has
one window and restarts it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import Qwen2_5OmniToken2WavModel

from omni_common.errors import InvalidArgument
from omni_common.execution.compile_cache import decisions_for
from omni_common.execution.cuda_graphs import CudaGraphCache
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.qwen_omni.checkpoint import load_config, load_part, load_speakers, speaker
from omni_common.models.qwen_omni.options import DEFAULT_SPEAKER, option_int, speaker_of
from omni_common.models.qwen_omni.resume import GENERATOR, generator_state, meta_int, restore_generator

FIRST_BLOCKS, CHUNK_BLOCKS, PAST_BLOCKS, FUTURE_BLOCKS = 1, 3, 2, 1
# (batch, blocks) of the streamed windows every reply solves: the first (FIRST_BLOCKS and the
# future), the second (from frame 0), the steady ones (past, chunk, future); two and MAX_OPEN
# batched (a replayed batch is padded to a power of two).
WARM_SHAPES = ((1, 2), (1, 5), (1, 6), (2, 6), (4, 6))
SWAY = -1.0  # Qwen2_5OmniToken2WavModel's sway_coefficient
# Windows of one utterance solved together (the stage's --max-batch, rows of a forward, bounds it
# too: at 1, one window a forward, and a reply's mel depends on its codes alone, bit for bit).
MAX_OPEN = 4


@dataclass(eq=False)
class Window:
    """The frames [start, end) being solved, of which [out_start, out_end) are kept."""

    start: int
    end: int
    out_start: int
    out_end: int
    y: torch.Tensor  # [1, end - start, mel_dim]
    codes: torch.Tensor  # [1, (end - start) / repeats]
    interval: int = 0  # RK4 intervals done


@dataclass(kw_only=True, eq=False)
class Token2WavState(StepState):
    streamed: bool
    guidance: float
    scale: torch.Tensor  # [1] the guidance on the device, read by the solver
    cond: torch.Tensor  # [1, enc_emb_dim]
    ref_mel: torch.Tensor  # [1, T_ref, mel_dim]
    generator: torch.Generator
    times: torch.Tensor  # [steps] the solver's time points
    codes: list[int] = field(default_factory=list)
    ended: bool = False
    noise: torch.Tensor | None = None  # [1, frames drawn - noise_from, mel_dim]
    noise_from: int = 0  # the first frame `noise` holds (earlier ones no window reads again)
    windows: list[Window] = field(default_factory=list)  # open, oldest first, of one length
    frames_done: int = 0  # the last frame kept of the windows solved
    # (first frame, the chunk's mel [D, n], the window's provisional frames after it [D, m])
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    chunks_sent: int = 0
    checkpointed: int = 0  # frames_done at the latest checkpoint


class Token2Wav:
    """The "token2wav" role (a StreamingRunner). Runs in float32, as transformers runs it (its
    products in TF32 on a GPU under the stage's --float32-matmul-precision, auto or high), or
    with the DiT in bfloat16 (`dtype`, the stage's --quantization bf16; the solver's arithmetic
    stays float32): an interval on an H100, compiled and replayed, 8.7 ms against TF32's 12.6 ms
    for one utterance, 22.1 against 40.2 ms for 8, the mel within 6e-3 relative L2
    (benchmarks/token2wav_gpu.py, docs/benchmarks.md).

    With `cuda_graphs` (the stage's --cuda-graphs) each RK4 interval (four DiT forwards and the
    solver's arithmetic) is replayed as one CUDA graph per batch and window length, captured at
    its first use: a window's forward is small and launch-bound. A replay runs the captured
    kernels, so the mel is the eager one's within float rounding (tests/gpu/
    test_qwen_omni_resume_gpu.py: 1e-5). With `compile` (the stage's --compile) the DiT's forward
    is compiled once for every batch and window length (dynamic shapes; 1e-4). Either way
    `idle_work` runs the windows every reply solves (WARM_SHAPES) before a request has to wait
    for their compile (~245 s at real size) or capture. An interval at real size on an H100,
    one utterance: 88.6 ms eager, 38.4 ms replayed, 27.4 ms replayed and compiled
    (benchmarks/token2wav_gpu.py)."""

    def __init__(
        self,
        dit: Any,
        speakers: dict[str, dict[str, Any]],
        device: torch.device,
        cuda_graphs: bool = False,
        compile: bool = False,
        max_open: int = MAX_OPEN,
    ) -> None:
        self.dit = dit
        self.max_open = max_open
        # The DiT's own dtype (float32 as transformers runs it); the solver stays in float32.
        self.dit_dtype = next(dit.parameters()).dtype
        self.speakers = speakers
        self.device = device
        # One compile for every batch and window length (dynamic shapes); graphs per shape.
        self._forward = torch.compile(dit.forward, dynamic=True) if compile else dit.forward
        self.graphs: CudaGraphCache | None = None
        if cuda_graphs and device.type == "cuda":
            # A compiled forward's gain differs, and a TF32 one's (the stage's precision).
            model = {
                **dit.config.to_dict(),
                "compiled": compile,
                "matmul": torch.get_float32_matmul_precision(),
                "dtype": str(self.dit_dtype),
            }
            decisions = decisions_for("token2wav-graphs", device, model)
            self.graphs = CudaGraphCache(device, decisions=decisions)
        self.repeats: int = dit.repeats
        self.block: int = dit.block_size
        self.mel_dim: int = dit.mel_dim
        self.codes_limit: int = dit.text_embed.codec_embed.num_embeddings
        # Shapes run once while idle (idle_work): the compile, and the common windows' graphs.
        self._unwarmed = list(WARM_SHAPES) if compile or self.graphs is not None else []

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        cuda_graphs: bool = False,
        compile: bool = False,
        max_open: int = MAX_OPEN,
        dtype: torch.dtype = torch.float32,
    ) -> Token2Wav:
        config = load_config(model_dir).token2wav_config
        token2wav = load_part(Qwen2_5OmniToken2WavModel, config, model_dir, "token2wav", device, dtype)
        dit = token2wav.code2wav_dit_model
        return cls(dit, load_speakers(model_dir), device, cuda_graphs, compile, max_open)

    def prepare(self, request: GenerationRequest, inputs: StageState) -> Token2WavState:
        voice = speaker(self.speakers, speaker_of(request))
        steps = request.num_inference_steps
        times = torch.linspace(0, 1, steps, device=self.device, dtype=torch.float32)
        times += SWAY * (torch.cos(torch.pi / 2 * times) - 1 + times)
        state = Token2WavState(
            request=request,
            step_index=0,
            total_steps=steps - 1,
            streamed=bool(option_int(request, "stream_audio")),
            guidance=request.true_cfg_scale,
            scale=self._on_device([request.true_cfg_scale], torch.float32),
            cond=voice["cond"].to(self.device, torch.float32),
            ref_mel=voice["ref_mel"].to(self.device, torch.float32),
            generator=torch.Generator(self.device).manual_seed(request.seed),
            times=times,
        )
        self.feed(state, inputs, end=False)
        return state

    def feed(self, state: StepState, chunk: StageState, end: bool) -> None:
        assert isinstance(state, Token2WavState)
        codes = chunk.tensors.get("codes")
        if codes is not None:
            if codes.dim() != 1 or codes.is_floating_point():
                raise InvalidArgument("a talker chunk's codes must be a 1-D integer tensor")
            if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codes_limit):
                raise InvalidArgument(f"codec tokens must lie in [0, {self.codes_limit})")
            state.codes += codes.tolist()
        state.ended = state.ended or end

    def _next_window(self, state: Token2WavState) -> tuple[int, int, int, int] | None:
        """(start, end, out_start, out_end) of the next window to open, if its codes are all here."""
        frames = len(state.codes) * self.repeats
        opened = state.windows[-1].out_end if state.windows else state.frames_done
        if opened >= frames and state.ended:
            return None
        if not state.streamed:
            return (0, frames, 0, frames) if state.ended else None
        out_start = opened
        out_end = out_start + (CHUNK_BLOCKS if out_start else FIRST_BLOCKS) * self.block
        if not state.ended and frames < out_end + FUTURE_BLOCKS * self.block:
            return None
        out_end = min(out_end, frames)
        start = max(0, out_start - PAST_BLOCKS * self.block)
        return start, min(frames, out_end + FUTURE_BLOCKS * self.block), out_start, out_end

    def ready(self, state: StepState) -> bool:
        """Whether a step has work for `state`: an open window, one to open, or a solved chunk
        still to hand over. Windows opened together close together, and a step hands over one
        chunk (take_partial): the others go out with the next steps, which solve nothing for
        this state if nothing else is left."""
        assert isinstance(state, Token2WavState)
        return (
            bool(state.windows)
            or bool(state.pending)
            or self._next_window(state) is not None
            or self.is_done(state)
        )

    def _on_device(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        """`values` as a tensor on the device, copied without waiting for the work queued there
        (a copy from pageable memory would)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _noise(self, state: Token2WavState, frames: int) -> torch.Tensor:
        """The utterance's noise from frame `noise_from` up to `frames`, drawn in order as it
        is needed."""
        have = state.noise_from + (0 if state.noise is None else state.noise.shape[1])
        if frames > have:
            more = torch.randn(
                [1, frames - have, self.mel_dim],
                generator=state.generator,
                device=self.device,
                dtype=torch.float32,
            )
            state.noise = more if state.noise is None else torch.cat([state.noise, more], dim=1)
        assert state.noise is not None
        return state.noise

    def _open(self, state: Token2WavState) -> None:
        """Open the windows whose codes are here, up to `max_open`, at the open ones' length."""
        limit = self.dit.config.max_position_embeddings
        while len(state.windows) < self.max_open and (bounds := self._next_window(state)) is not None:
            start, end, out_start, out_end = bounds
            if state.windows and end - start != state.windows[0].y.shape[1]:
                return
            if end > limit:
                raise InvalidArgument(f"the reply's mel is {end} frames; token2wav holds at most {limit}")
            codes = self._on_device([state.codes[start // self.repeats : end // self.repeats]], torch.long)
            noise = self._noise(state, end)[:, start - state.noise_from : end - state.noise_from]
            state.windows.append(Window(start, end, out_start, out_end, noise.clone(), codes))

    def batch_key(self, state: StepState) -> Hashable:
        assert isinstance(state, Token2WavState)
        if state.windows:
            length = state.windows[0].y.shape[1]
        else:
            bounds = self._next_window(state)
            length = 0 if bounds is None else bounds[1] - bounds[0]
        return (length, tuple(state.ref_mel.shape), state.guidance >= 1e-5)

    def step_cost(self, state: StepState) -> int:
        return CHUNK_BLOCKS * self.block * 2

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        """One RK4 interval of every state's open windows (windows open when their codes are
        here), one forward per window length."""
        live = [s for s in states if isinstance(s, Token2WavState)]
        for state in live:
            self._open(state)
        by_length: dict[tuple[int, bool], list[tuple[Token2WavState, Window]]] = {}
        for state in live:
            for window in state.windows:
                by_length.setdefault((window.y.shape[1], state.guidance >= 1e-5), []).append((state, window))
        for (frames, cfg), rows in by_length.items():
            inputs = {
                "y": torch.cat([w.y for _, w in rows]),
                "start": torch.stack([s.times[w.interval] for s, w in rows]),
                "end": torch.stack([s.times[w.interval + 1] for s, w in rows]),
                "speaker": torch.cat([s.cond.unsqueeze(1).repeat(1, frames, 1) for s, _ in rows]),
                "reference": torch.cat([s.ref_mel for s, _ in rows]),
                "codes": torch.cat([w.codes for _, w in rows]),
                "guidance": torch.cat([s.scale for s, _ in rows]),
            }
            for (_, window), y in zip(rows, self._run(inputs, cfg).split(1), strict=True):
                window.y = y
                window.interval += 1
        for state in live:
            while state.windows and state.windows[0].interval == state.total_steps:
                self._close(state)

    def _run(self, inputs: dict[str, torch.Tensor], cfg: bool) -> torch.Tensor:
        """One RK4 interval of a batch: replayed as a CUDA graph where one is kept, its rows
        padded to a power of two (copies of the last, dropped after), else eager."""

        def interval(given: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._interval(given, cfg)

        if self.graphs is not None:
            rows = inputs["y"].shape[0]
            padded = {name: _pad_rows(value, 1 << (rows - 1).bit_length()) for name, value in inputs.items()}
            key = (cfg, *(tuple(value.shape) for value in padded.values()))
            y = self.graphs.run(key, padded, interval, decision_key="interval")
            if y is not None:
                return y[:rows]
        return interval(inputs)

    def _interval(self, given: dict[str, torch.Tensor], cfg: bool) -> torch.Tensor:
        """One RK4 interval of `sample`'s solver for a batch of windows: `RungeKutta4ODESolver`'s
        3/8 rule, each row's arithmetic elementwise as the solver does it for one utterance."""
        y, start, end = given["y"], given["start"], given["end"]
        dt = end - start
        h = dt.view(-1, 1, 1)
        third, two_thirds = 1 / 3, 2 / 3
        k1 = self._velocity(given, start, y, cfg)
        k2 = self._velocity(given, start + dt * third, y + h * k1 * third, cfg)
        k3 = self._velocity(given, start + dt * two_thirds, y + h * (k2 - k1 * third), cfg)
        k4 = self._velocity(given, end, y + h * (k1 - k2 + k3), cfg)
        return y + (k1 + 3 * (k2 + k3) + k4) * h / 8

    def _velocity(
        self, given: dict[str, torch.Tensor], time: torch.Tensor, y: torch.Tensor, cfg: bool
    ) -> torch.Tensor:
        """The guided ODE function of `sample` for every row, in one DiT forward (conditional
        and unconditional rows together)."""
        dtype = self.dit_dtype
        output = self._forward(
            hidden_states=y.to(dtype),
            speaker_embedding=given["speaker"].to(dtype),
            condition_vector=given["reference"].to(dtype),
            quantized_code=given["codes"],
            time_step=time.to(dtype),
            apply_cfg=cfg,
        ).float()
        if not cfg:
            return cast(torch.Tensor, output)
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * given["guidance"].view(-1, 1, 1)

    @torch.no_grad()
    def idle_work(self) -> bool:
        """HasIdleWork: one common shape's interval run on placeholder inputs (the default
        speaker, zero codes and mel), so that the compile and the graph a first request would
        wait for are done before it comes."""
        if not self._unwarmed:
            return False
        batch, blocks = self._unwarmed.pop(0)
        voice = speaker(self.speakers, DEFAULT_SPEAKER)
        frames = blocks * self.block
        cond = voice["cond"].to(self.device, torch.float32)
        self._run(
            {
                "y": torch.zeros(batch, frames, self.mel_dim, device=self.device),
                "start": torch.zeros(batch, device=self.device),
                "end": torch.full((batch,), 0.1, device=self.device),
                "speaker": cond.unsqueeze(1).repeat(batch, frames, 1),
                "reference": voice["ref_mel"].to(self.device, torch.float32).repeat(batch, 1, 1),
                "codes": torch.zeros(batch, frames // self.repeats, dtype=torch.long, device=self.device),
                "guidance": torch.full((batch,), 0.5, device=self.device),
            },
            cfg=True,
        )
        return True

    def idle_work_left(self) -> int:
        return len(self._unwarmed)

    def _close(self, state: Token2WavState) -> None:
        """The oldest open window is solved: its chunk is pending."""
        window = state.windows.pop(0)
        mel = window.y[0].transpose(0, 1)
        kept = mel[:, window.out_start - window.start : window.out_end - window.start].contiguous()
        lookahead = mel[:, window.out_end - window.start :].contiguous()
        state.pending.append((window.out_start, kept, lookahead))
        state.frames_done = window.out_end
        # Later windows start at most PAST_BLOCKS before the next chunk: the noise before is done.
        keep = max(0, state.frames_done - PAST_BLOCKS * self.block)
        if state.noise is not None and keep > state.noise_from:
            state.noise = state.noise[:, keep - state.noise_from :].clone()
            state.noise_from = keep

    def take_partial(self, state: StepState) -> StageState | None:
        assert isinstance(state, Token2WavState)
        if not state.pending:
            return None
        frame, mel, lookahead = state.pending.pop(0)
        meta = {"chunk": str(state.chunks_sent), "frame": str(frame)}
        state.chunks_sent += 1
        return StageState(tensors={"mel": mel, "lookahead": lookahead}, meta=meta)

    def is_done(self, state: StepState) -> bool:
        assert isinstance(state, Token2WavState)
        return state.ended and not state.windows and not state.pending and self._next_window(state) is None

    def is_finite(self, state: StepState) -> bool | torch.Tensor:
        assert isinstance(state, Token2WavState)
        if not state.windows:
            return True
        return torch.stack([torch.isfinite(window.y).all() for window in state.windows]).all()

    def preview(self, state: StepState) -> np.ndarray | None:
        return None

    def checkpoint(self, state: StepState) -> StageState | None:
        """Once per window solved, its chunk taken (None in between, and for a one-shot
        request, whose one window ends it): the noise drawn from where the next window to solve
        reads (windows open after it are solved again on a resume), the generator, the frames
        and chunks done."""
        assert isinstance(state, Token2WavState)
        if not state.streamed or state.pending:
            return None
        if state.frames_done <= state.checkpointed:
            return None
        state.checkpointed = state.frames_done
        noise = state.noise if state.noise is not None else torch.zeros(1, 0, self.mel_dim)
        meta = {"frames_done": str(state.frames_done), "chunks_sent": str(state.chunks_sent)}
        meta["noise_from"] = str(state.noise_from)
        return StageState({"noise": noise.clone(), GENERATOR: generator_state(state.generator)}, meta)

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        """Move a state fresh from `prepare` to the checkpoint's window, noise and generator."""
        assert isinstance(state, Token2WavState)
        if not state.streamed:
            raise InvalidArgument("a one-shot token2wav request does not resume")
        limit = self.dit.config.max_position_embeddings
        frames_done = meta_int(checkpoint, "frames_done", 1, limit)
        noise_from = meta_int(checkpoint, "noise_from", 0, frames_done)
        if noise_from != max(0, frames_done - PAST_BLOCKS * self.block):
            raise InvalidArgument("the token2wav checkpoint's noise must start where the next window reads")
        noise = checkpoint.tensors.get("noise")
        shape = None if noise is None else (noise.dim(), noise.shape[0], noise.shape[-1])
        if noise is None or shape != (3, 1, self.mel_dim) or not noise.is_floating_point():
            raise InvalidArgument(f"a token2wav checkpoint's noise must be [1, n, {self.mel_dim}] float")
        if noise.shape[1] < frames_done - noise_from:
            raise InvalidArgument("the token2wav checkpoint's noise ends before its frames do")
        state.chunks_sent = meta_int(checkpoint, "chunks_sent", 1, frames_done)
        restore_generator(state.generator, checkpoint)
        state.noise = noise.to(self.device, torch.float32)
        state.noise_from = noise_from
        state.frames_done = state.checkpointed = frames_done

    def finish(self, state: StepState) -> StageState:
        assert isinstance(state, Token2WavState)
        return StageState(tensors={}, meta={"frames": str(state.frames_done)})

    def release(self, state: StepState) -> None:
        pass

    def forget_cuda_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
            self._unwarmed = list(WARM_SHAPES)


def _pad_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    """`value` with copies of its last row appended up to `rows` rows."""
    missing = rows - value.shape[0]
    return value if missing == 0 else torch.cat([value, value[-1:].expand(missing, *value.shape[1:])])
