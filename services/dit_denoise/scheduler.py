"""StepScheduler: continuous step-level batching for the DiT.

Requests join and leave between any two denoising steps. Each iteration:
1. drops jobs whose caller went away or whose deadline passed;
2. takes the oldest job and, in arrival order, the other jobs with its batch key (same
   resolution, CFG, dtype) up to `max_batch` jobs and `max_tokens` image tokens;
3. runs one step for all of them in one forward (the runner batches), then reports
   progress and retires the finished ones.
Serving the oldest job's group first keeps it first come, first served: a request waits
at most for the requests that arrived before it, never for a stream of later ones.
A step that fails is retried job by job, so one bad request fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omni_common.errors import DeadlineExceeded, OmniError, ResourceExhausted
from omni_common.imaging import to_png
from omni_common.models.base import DenoiserRunner, DenoiseState, StageState
from omni_common.runtime.worker import Progress, StageCall

log = logging.getLogger("omnistage.dit-denoise")
T = TypeVar("T")
Compute = Callable[..., Awaitable[Any]]

Event = Progress | StageState | OmniError


@dataclass(eq=False)
class Job:
    call: StageCall
    state: DenoiseState
    tokens: int
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    gone: bool = False  # the caller stopped listening (cancelled, disconnected, done)


def _preview_png(runner: DenoiserRunner, state: DenoiseState) -> bytes:
    return to_png(runner.preview(state))


def image_tokens(call: StageCall) -> int:
    """Transformer image tokens of one step: (H/16)(W/16), doubled by CFG."""
    request = call.request
    return (request.width // 16) * (request.height // 16) * (2 if request.do_true_cfg else 1)


class StepScheduler:
    def __init__(
        self,
        runner: DenoiserRunner,
        compute: Compute,
        *,
        max_batch: int = 8,
        max_tokens: int = 65536,
        max_queue: int = 64,
    ) -> None:
        self.runner = runner
        self.compute = compute
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_queue = max_queue
        self.jobs: list[Job] = []  # in arrival order
        self.step_ms = 0.0  # duration of the last step, for retry hints
        self.batch_sizes: list[int] = []  # recent forward batch sizes (observability, tests)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def queued_steps(self) -> int:
        return sum(job.state.total_steps - job.state.step_index for job in self.jobs)

    def queued_work(self) -> int:
        return sum((job.state.total_steps - job.state.step_index) * job.tokens for job in self.jobs)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        """Admit one request and stream its progress, then its result."""
        if len(self.jobs) >= self.max_queue:
            wait_ms = max(1, round(self.queued_steps() / self.max_batch * self.step_ms))
            raise ResourceExhausted(
                f"dit-denoise is at capacity ({len(self.jobs)} requests); retry in about {wait_ms} ms",
                retry_after_ms=wait_ms,
            )
        state = await self.compute(self.runner.prepare, call.request, call.inputs)
        if call.resume is not None:
            await self.compute(self.runner.restore, state, call.resume)
        job = Job(call, state, image_tokens(call))
        self.jobs.append(job)
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
            self._wake.set()

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
            if not self.jobs:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._pick()
            try:
                started = time.perf_counter()
                stepped = await self._step(batch)
                self.step_ms = (time.perf_counter() - started) * 1e3
                self.batch_sizes = [*self.batch_sizes[-99:], len(batch)]
                for job in stepped:
                    await self._report(job, self.step_ms)
            except Exception:  # a fault of the scheduler itself: fail the batch, keep serving
                for job in batch:
                    self._fail(job)

    def _drop_dead(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs):
            if job.gone:
                self.jobs.remove(job)
            elif job.call.deadline is not None and now >= job.call.deadline:
                self.jobs.remove(job)
                state = job.state
                job.events.put_nowait(
                    DeadlineExceeded(
                        f"request {job.call.request_id}: the deadline passed at step "
                        f"{state.step_index}/{state.total_steps}; dropped before more compute"
                    )
                )

    def _pick(self) -> list[Job]:
        oldest = self.jobs[0]
        key = self.runner.batch_key(oldest.state)
        batch, tokens = [oldest], oldest.tokens
        for job in self.jobs[1:]:
            if len(batch) >= self.max_batch:
                break
            if self.runner.batch_key(job.state) == key and tokens + job.tokens <= self.max_tokens:
                batch.append(job)
                tokens += job.tokens
        return batch

    async def _step(self, batch: list[Job]) -> list[Job]:
        """One step for `batch`; returns the jobs that stepped (failed ones are retired)."""
        try:
            await self.compute(self.runner.step, [job.state for job in batch])
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
                self._retire(job, OmniError(f"request {job.call.request_id}: denoising produced NaN or Inf"))
        return healthy

    def _fail(self, job: Job) -> None:
        log.exception("request %s: denoising step failed", job.call.request_id)
        self._retire(job, OmniError(f"internal error in dit-denoise (request {job.call.request_id})"))

    def _retire(self, job: Job, event: Event) -> None:
        if job in self.jobs:
            self.jobs.remove(job)
        job.events.put_nowait(event)

    async def _report(self, job: Job, step_ms: float) -> None:
        state, call = job.state, job.call
        done = state.step_index
        every = max(call.progress_every, 1)
        checkpoint = call.checkpoint_every and done % call.checkpoint_every == 0 and done < state.total_steps
        if done % every == 0 or done == state.total_steps or checkpoint:
            progress = Progress(step=done, total=state.total_steps, step_ms=step_ms)
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
