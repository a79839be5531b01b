"""What a step scheduler keeps of its requests and steps: a `Job` (a request being stepped,
and its events to the caller), a `Launched` step (what its reports need once the device has
run it, made by `advance` on the compute thread) and the log line of a finished job."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_common.errors import OmniError
from omni_common.imaging import to_png
from omni_common.models.base import LateFlag, StageState, StepRunner, StepState
from omni_common.models.capabilities import StreamingRunner
from omni_common.net import tracing
from omni_common.runtime.calls import Progress, StageCall

log = logging.getLogger("omnistage.steps")
Event = Progress | StageState | OmniError


@dataclass(eq=False)
class Job:
    call: StageCall
    state: StepState
    cost: int  # compute units of one step
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    gone: bool = False  # the caller stopped listening (cancelled, disconnected, done)
    pump: asyncio.Task[None] | None = None  # moves a streaming call's input chunks in
    partial: StageState | None = None  # the chunk its last step made (streaming runners)
    last_step: float = 0.0  # time.monotonic() of its last step; 0 before the first
    finishing: bool = False  # its last launched step finished it: never step it again
    admitted: float = field(default_factory=time.monotonic)  # its prepare (prefill) done
    called: float = 0.0  # time.monotonic() when its call reached the stage, before its prepare
    first_chunk: float = 0.0  # time.monotonic() when its first chunk was reported (streaming)
    waiting: Any = tracing.NO_SPAN  # its wait for its first step (tracing.start)
    steps_ms: list[float] = field(default_factory=list)  # each step's time (device time on a GPU)
    batches: list[int] = field(default_factory=list)  # the batch size of each of its steps

    def end_wait(self) -> None:
        self.waiting.end()
        self.waiting = tracing.NO_SPAN


@dataclass(eq=False)
class Launched:
    """One step launched for `jobs`, and what their reports need once it has completed: the
    step each job reached, its NaN flag (maybe still on the device), its checkpoint."""

    jobs: list[Job]
    done: list[int]
    finished: list[bool]  # the step was the job's last (runner.is_done after it)
    finite: list[bool | torch.Tensor | LateFlag]
    checkpoints: list[StageState | None]
    previews: list[bool]  # a preview is due: the step completes before the next launch
    started_at: float  # time.perf_counter() at launch
    start: torch.cuda.Event | None = None  # device events around the step (CUDA only)
    end: torch.cuda.Event | None = None

    @property
    def wait(self) -> bool:
        """Complete it before launching the next: a preview reads the state."""
        return any(self.previews)

    @property
    def answers_late(self) -> bool:
        """Its NaN flags come after the step returned (LateFlag): the next step may be launched
        before they are read, on any device."""
        return any(isinstance(flag, LateFlag) for flag in self.finite)

    def read_late_flags(self) -> None:
        """The LateFlags read (on the compute thread: they wait for their answers)."""
        self.finite = [flag.read() if isinstance(flag, LateFlag) else flag for flag in self.finite]


def advance(runner: StepRunner, batch: list[Job], streaming: StreamingRunner | None, timed: bool) -> Launched:
    """One step of `batch` on the compute thread, and what its reports will need: (streaming)
    the chunks it made, the NaN flags and checkpoints, the device events around it (`timed`:
    CUDA). Nothing here waits for the device, except a streaming runner reading its tokens."""
    started_at, start, end = time.perf_counter(), None, None
    if timed:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    runner.step([job.state for job in batch])
    for job in batch:
        job.finishing = runner.is_done(job.state)
    if streaming is not None:
        for job in batch:
            job.partial = streaming.take_partial(job.state)
    launched = Launched(
        jobs=batch,
        done=[job.state.step_index for job in batch],
        finished=[job.finishing for job in batch],
        finite=flags_on_host([runner.is_finite(job.state) for job in batch]),
        checkpoints=[checkpoint_due(runner, job) for job in batch],
        previews=[preview_due(job) for job in batch],
        started_at=started_at,
    )
    if timed:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        launched.start, launched.end = start, end
    return launched


def checkpoint_due(runner: StepRunner, job: Job) -> StageState | None:
    every, done = job.call.checkpoint_every, job.state.step_index
    if every and done % every == 0 and done < job.state.total_steps:
        return runner.checkpoint(job.state)
    return None


def preview_due(job: Job) -> bool:
    every, done = job.call.preview_every, job.state.step_index
    return bool(every) and (done % every == 0 or done == job.state.total_steps)


def preview_png(runner: StepRunner, state: StepState) -> bytes:
    picture = runner.preview(state)
    return b"" if picture is None else to_png(picture)


def log_steps(name: str, job: Job) -> None:
    """Where a finished request's steps went: its first step (a new shape's compile or graph
    capture shows there), the median of the rest, and the batches it stepped in; then its
    timeline in the stage, from its call: prepared (a prefill, a first window) and, streaming,
    its first chunk reported (what a time to first audio is made of, stage by stage)."""
    steps = job.steps_ms
    later = sorted(steps[1:]) or steps
    timeline = ""
    if job.called:
        timeline = f"; prepared {(job.admitted - job.called) * 1e3:.0f} ms after its call"
        if job.first_chunk:
            timeline += f", first chunk at {(job.first_chunk - job.called) * 1e3:.0f} ms"
    log.info(
        "request %s: %d steps on %s in %.0f ms: first %.1f ms, median %.1f ms; batches %s%s",
        job.call.request_id,
        len(steps),
        name,
        sum(steps),
        steps[0],
        later[len(later) // 2],
        runs_of(job.batches),
        timeline,
    )


def runs_of(sizes: list[int]) -> str:
    """Batch sizes as runs: [1, 8, 8, 8] -> "1, 8x3"."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return ", ".join(f"{size}x{count}" if count > 1 else str(size) for size, count in runs)


def flags_on_host(flags: list[bool | torch.Tensor | LateFlag]) -> list[bool | torch.Tensor | LateFlag]:
    """NaN flags as host values; flags on a GPU are copied into pinned memory without waiting
    (valid once the step's end event, recorded after the copy, has passed): reading a device
    value directly would wait for every step queued behind it. Flags on the host become bools;
    LateFlags stay (Launched.read_late_flags)."""
    on_device = [i for i, flag in enumerate(flags) if isinstance(flag, torch.Tensor) and flag.is_cuda]
    out: list[bool | torch.Tensor | LateFlag] = [
        flag if i in on_device or isinstance(flag, LateFlag) else bool(flag) for i, flag in enumerate(flags)
    ]
    if on_device:
        device = torch.stack([torch.as_tensor(flags[i]).reshape(()) for i in on_device])
        host = torch.empty(device.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(device, non_blocking=True)
        for i, value in zip(on_device, host, strict=True):
            out[i] = value
    return out


def joined(parts: list[Launched]) -> Launched | None:
    """Steps launched one job at a time (after a batch failed), reported as one."""
    if not parts:
        return None
    return Launched(
        jobs=[job for part in parts for job in part.jobs],
        done=[done for part in parts for done in part.done],
        finished=[f for part in parts for f in part.finished],
        finite=[flag for part in parts for flag in part.finite],
        checkpoints=[c for part in parts for c in part.checkpoints],
        previews=[p for part in parts for p in part.previews],
        started_at=parts[0].started_at,
        start=parts[0].start,
        end=parts[-1].end,
    )
