"""StepScheduler: continuous step-level batching of a step-wise role (a StepRunner): the DiT's
denoising loop, an autoregressive model's token generation.

Requests join and leave between any two steps. Each iteration:
1. drops jobs whose caller went away or whose deadline passed;
2. takes the oldest job and, in arrival order, the other jobs with its batch key (e.g. same
   resolution, CFG, dtype) up to `max_batch` jobs and `max_tokens` compute units per step
   (the runner's `step_cost`: image tokens x CFG passes for a DiT, 1 for a token);
3. runs one step for all of them in one forward (the runner batches), then reports
   progress and retires the finished ones.
Serving the oldest job's group first keeps it first come, first served: a request waits
at most for the requests that arrived before it, never for a stream of later ones.
A step that fails is retried job by job, so one bad request fails alone.

A streaming runner (omni_common.models.base.StreamingRunner) also sends each job's output
in chunks as it is made (a progress event carrying the chunk after the step that made it), and
takes a streaming call's later input chunks from its inbox between steps; a job steps only when
it is `ready` (its next step's input has arrived), so a waiting job never holds up others, and
the job that stepped longest ago picks the batch (a long stream must not starve a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omni_common.errors import DeadlineExceeded, OmniError, ResourceExhausted
from omni_common.imaging import to_png
from omni_common.models.base import StageState, StepRunner, StepState, StreamingRunner
from omni_common.runtime.calls import Progress, StageCall

log = logging.getLogger("omnistage.steps")
IDLE_CHECK_S = 0.5  # while every job waits for input: how often deadlines are checked
T = TypeVar("T")
Compute = Callable[..., Awaitable[Any]]

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


def _preview_png(runner: StepRunner, state: StepState) -> bytes:
    picture = runner.preview(state)
    return b"" if picture is None else to_png(picture)


class StepScheduler:
    def __init__(
        self,
        runner: StepRunner,
        compute: Compute,
        *,
        max_batch: int = 8,
        max_tokens: int = 65536,
        max_queue: int = 64,
        name: str = "dit-denoise",
    ) -> None:
        self.runner = runner
        self.name = name
        self.compute = compute
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_queue = max_queue
        self.jobs: list[Job] = []  # in arrival order
        self.step_ms = 0.0  # duration of the last step, for retry hints
        self.batch_sizes: list[int] = []  # recent forward batch sizes (observability, tests)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._left: list[StepState] = []  # states of jobs that left unfinished, to release
        self.streaming: StreamingRunner | None = (
            runner if hasattr(runner, "take_partial") else None  # type: ignore[assignment]
        )

    def queued_steps(self) -> int:
        return sum(job.state.total_steps - job.state.step_index for job in self.jobs)

    def queued_work(self) -> int:
        return sum((job.state.total_steps - job.state.step_index) * job.cost for job in self.jobs)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        """Admit one request and stream its progress, then its result."""
        if len(self.jobs) >= self.max_queue:
            wait_ms = max(1, round(self.queued_steps() / self.max_batch * self.step_ms))
            raise ResourceExhausted(
                f"{self.name} is at capacity ({len(self.jobs)} requests); retry in about {wait_ms} ms",
                retry_after_ms=wait_ms,
            )
        state = await self.compute(self.runner.prepare, call.request, call.inputs)
        if call.resume is not None:
            try:
                await self.compute(self.runner.restore, state, call.resume)
            except BaseException:
                self.runner.release(state)
                raise
        job = Job(call, state, self.runner.step_cost(state))
        self.jobs.append(job)
        if call.inbox is not None:
            job.pump = asyncio.create_task(self._pump(job))
        self._ensure_loop()
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, OmniError):
                    raise event
                yield event
                if isinstance(event, StageState):
                    return
        finally:
            job.gone = True
            if job.pump is not None:
                job.pump.cancel()
            self._wake.set()

    async def _pump(self, job: Job) -> None:
        """Feed a streaming call's input chunks to its state, between steps."""
        assert job.call.inbox is not None and self.streaming is not None
        try:
            async for chunk in job.call.inbox.chunks():
                if job.gone or job not in self.jobs:
                    return
                await self.compute(self.streaming.feed, job.state, chunk.state, chunk.end)
                self._wake.set()
        except OmniError as err:
            self._retire(job, err)
        except Exception:
            self._fail(job)

    def _ready(self, job: Job) -> bool:
        return self.streaming is None or self.streaming.ready(job.state)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._drop_dead()
            await self._release_left()
            if not self.jobs:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not any(self._ready(job) for job in self.jobs):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_CHECK_S)
                continue
            batch = self._pick()
            try:
                started = time.perf_counter()
                stepped = await self._step(batch)
                self.step_ms = (time.perf_counter() - started) * 1e3
                self.batch_sizes = [*self.batch_sizes[-99:], len(batch)]
                now = time.monotonic()
                for job in stepped:
                    job.last_step = now
                    await self._report(job, self.step_ms)
            except Exception:  # a fault of the scheduler itself: fail the batch, keep serving
                for job in batch:
                    self._fail(job)

    def _drop_dead(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs):
            if job.gone:
                self.jobs.remove(job)
                self._left.append(job.state)
            elif job.call.deadline is not None and now >= job.call.deadline:
                self.jobs.remove(job)
                state = job.state
                self._left.append(state)
                job.events.put_nowait(
                    DeadlineExceeded(
                        f"request {job.call.request_id}: the deadline passed at step "
                        f"{state.step_index}/{state.total_steps}; dropped before more compute"
                    )
                )

    def _pick(self) -> list[Job]:
        ready = [job for job in self.jobs if self._ready(job)]
        if self.streaming is not None:
            # A stream's latency is per chunk: the job that stepped longest ago goes first
            # (arrival order among equals), so a long stream never starves a newer one's start.
            ready.sort(key=lambda job: job.last_step)
        oldest = ready[0]
        key = self.runner.batch_key(oldest.state)
        batch, cost = [oldest], oldest.cost
        for job in ready[1:]:
            if len(batch) >= self.max_batch:
                break
            if self.runner.batch_key(job.state) == key and cost + job.cost <= self.max_tokens:
                batch.append(job)
                cost += job.cost
        return batch

    def _advance(self, batch: list[Job]) -> None:
        """One step, and (streaming) the chunks it made, in one call on the compute thread."""
        self.runner.step([job.state for job in batch])
        if self.streaming is not None:
            for job in batch:
                job.partial = self.streaming.take_partial(job.state)

    async def _step(self, batch: list[Job]) -> list[Job]:
        """One step for `batch`; returns the jobs that stepped (failed ones are retired)."""
        try:
            await self.compute(self._advance, batch)
        except Exception:
            if len(batch) == 1:
                self._fail(batch[0])
                return []
            log.warning("a step of %d requests failed; retrying them one by one", len(batch))
            stepped = []
            for job in batch:
                stepped += await self._step([job])
            return stepped
        healthy = []
        for job in batch:
            if self.runner.is_finite(job.state):
                healthy.append(job)
            else:
                log.error("request %s: the step produced NaN or Inf", job.call.request_id)
                self._retire(
                    job, OmniError(f"request {job.call.request_id}: {self.name} produced NaN or Inf")
                )
        return healthy

    def _fail(self, job: Job) -> None:
        log.exception("request %s: %s step failed", job.call.request_id, self.name)
        self._retire(job, OmniError(f"internal error in {self.name} (request {job.call.request_id})"))

    def _retire(self, job: Job, event: Event) -> None:
        if job in self.jobs:
            self.jobs.remove(job)
            self._left.append(job.state)
        job.events.put_nowait(event)

    async def _release_left(self) -> None:
        """Free what unfinished jobs held (a KV slot), between steps: no step uses them then."""
        while self._left:
            state = self._left.pop()
            try:
                await self.compute(self.runner.release, state)
            except Exception:
                log.exception("%s: releasing a request's state failed", self.name)

    async def _report(self, job: Job, step_ms: float) -> None:
        state, call = job.state, job.call
        done = state.step_index
        every = max(call.progress_every, 1)
        checkpoint = call.checkpoint_every and done % call.checkpoint_every == 0 and done < state.total_steps
        partial, job.partial = job.partial, None
        if done % every == 0 or done == state.total_steps or checkpoint or partial is not None:
            progress = Progress(step=done, total=state.total_steps, step_ms=step_ms, partial=partial)
            if call.preview_every and (done % call.preview_every == 0 or done == state.total_steps):
                progress.preview_png = await self.compute(_preview_png, self.runner, state)
            if checkpoint:
                progress.checkpoint = await self.compute(self.runner.checkpoint, state)
            job.events.put_nowait(progress)
        if self.runner.is_done(state):
            self.jobs.remove(job)
            try:
                job.events.put_nowait(await self.compute(self.runner.finish, state))
            except Exception:
                self._fail(job)
