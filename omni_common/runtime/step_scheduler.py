"""StepScheduler: continuous step-level batching of a step-wise role (a StepRunner): the DiT's
denoising loop, an autoregressive model's token generation.

Requests join and leave between any two steps. Each iteration:
1. drops jobs whose caller went away or whose deadline passed;
2. picks the next batch: the oldest job's batch key group, first come, first served, within
   `max_batch` jobs and `max_tokens` compute units (the choices are step_policy.py's, pure);
3. runs one step for all of them in one forward (the runner batches), then reports
   progress and retires the finished ones.
A step that fails is retried job by job, so one bad request fails alone.

A streaming runner (omni_common.models.capabilities.StreamingRunner) also sends each job's output
in chunks as it is made (a progress event carrying the chunk after the step that made it), and
takes a streaming call's later input chunks from its inbox between steps; a job steps only when
it is `ready` (its next step's input has arrived), so a waiting job never holds up others, and
the job that stepped longest ago picks the batch (a long stream must not starve a new one).

On a GPU (`overlap`) the loop keeps the device fed: step k+1 is launched before step k's
results are read, so the host's bookkeeping (NaN check, progress, finishing requests, picking
the next batch, the asyncio hop) runs while the device computes. A step's NaN flags and
timings are device tensors and events, read once the step's end event has passed; nothing
syncs the device between steps except a requested preview (it reads the latents: that step
completes before the next is launched). Checkpoints are device copies taken at launch.
Requests that finish at step k are known on the host at launch (runner.is_done), so they
are never stepped again; one whose step k made NaN may be stepped once more, then fails alone.
Streaming runners read their tokens every step and are never overlapped. A replica over
several devices overlaps the same way whatever its server's device: its runner sends each step
to the device workers and answers with LateFlags, read after the next step was sent, so the
workers find step k+1 waiting when step k ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from omni_common.errors import DeadlineExceeded, OmniError, ResourceExhausted, Unavailable
from omni_common.models.base import StageState, StepRunner, StepState
from omni_common.models.capabilities import HasIdleWork, PlacesRequests, PrefillsInChunks, StreamingRunner
from omni_common.net import tracing
from omni_common.runtime.calls import FINISHED_WITH, Progress, StageCall
from omni_common.runtime.step_jobs import Event, Job, Launched, advance, joined, log_steps, preview_png
from omni_common.runtime.step_policy import ADMIT_WAIT_S, Queued, StepLimits, StepPlan, plan_step
from omni_common.stages import MAX_BATCH, MAX_QUEUE

log = logging.getLogger("omnistage.steps")
IDLE_CHECK_S = 0.5  # while every job waits for input: how often deadlines are checked
T = TypeVar("T")
Compute = Callable[..., Awaitable[Any]]


@dataclass
class StepTotals:
    """Steps run by one scheduler and where their time went (metrics): device time inside
    the steps and device idle time between consecutive steps of a running request (CUDA;
    zero elsewhere)."""

    steps: int = 0
    device_s: float = 0.0
    idle_s: float = 0.0
    idle_work_left: int = 0  # units of the runner's idle work still to do (HasIdleWork)
    # A generator's prompt-prefix cache (SupportsPrefixCache): lookups that reused a prefix,
    # lookups that found none, and the bytes it holds.
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_bytes: int = 0
    # A generator that prefills long prompts a chunk per step (PrefillsInChunks): chunks run.
    prefill_chunks: int = 0


class StepScheduler:
    def __init__(
        self,
        runner: StepRunner,
        compute: Compute,
        *,
        max_batch: int = MAX_BATCH,
        max_tokens: int = 65536,
        max_queue: int = MAX_QUEUE,
        name: str = "dit-denoise",
        device: torch.device | None = None,
        overlap: bool | None = None,
        batch_window_s: float = 0.0,
        admit_wait_s: float = ADMIT_WAIT_S,
    ) -> None:
        self.runner = runner
        self.name = name
        self.compute = compute
        self.limits = StepLimits(
            max_batch=max_batch,
            max_tokens=max_tokens,
            batch_window_s=batch_window_s,
            admit_wait_s=admit_wait_s,
        )
        self.max_queue = max_queue
        self.jobs: list[Job] = []  # in arrival order
        self.step_ms = 0.0  # duration of the last step, for retry hints
        self.batch_sizes: list[int] = []  # recent forward batch sizes (observability, tests)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._left: list[StepState] = []  # states of jobs that left unfinished, to release
        self.streaming: StreamingRunner | None = runner if isinstance(runner, StreamingRunner) else None
        self.chunked: PrefillsInChunks | None = runner if isinstance(runner, PrefillsInChunks) else None
        # Device events time the steps on a GPU; `overlap` defaults to on there (see above).
        self.timed = device is not None and device.type == "cuda"
        self.overlap = (self.timed if overlap is None else overlap) and self.streaming is None
        self.totals = StepTotals()
        self._admitting = 0  # requests whose state is being prepared, about to join
        self._last_end: torch.cuda.Event | None = None  # the previous step's end (idle time)
        self._last_jobs: set[int] = set()  # the previous step's jobs (ids)
        self._last_reported_at = 0.0  # time.perf_counter() when the previous step was reported
        self._idle_ok = True  # the runner's idle work has not failed
        self._count_idle_work()
        if self.totals.idle_work_left:
            self._start_idle_work()

    def _start_idle_work(self) -> None:
        """Start the loop for the idle work a runner has from the start (a warm start's
        deferred warm-up), not at the first request; made outside an event loop, the loop
        starts with the first request as usual."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._ensure_loop()

    def queued_steps(self) -> int:
        return sum(job.state.total_steps - job.state.step_index for job in self.jobs)

    def queued_work(self) -> int:
        return sum((job.state.total_steps - job.state.step_index) * job.cost for job in self.jobs)

    def _prepare(self, call: StageCall) -> StepState:
        """The runner's prepare; a runner that places requests learns how many more are coming
        (the call's followers and the others being admitted now)."""
        if isinstance(self.runner, PlacesRequests):
            arriving = call.followers + self._admitting - 1
            return self.runner.prepare_among(call.request, call.inputs, arriving)
        return self.runner.prepare(call.request, call.inputs)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        """Admit one request and stream its progress, then its result."""
        # Requests still being prepared count: a burst must not pass the bound while the first
        # ones of it are admitted.
        held = len(self.jobs) + self._admitting
        if held >= self.max_queue:
            wait_ms = max(1, round(self.queued_steps() / self.limits.max_batch * self.step_ms))
            raise ResourceExhausted(
                f"{self.name} is at capacity ({held} requests); retry in about {wait_ms} ms",
                retry_after_ms=wait_ms,
            )
        self._admitting += 1
        called = time.monotonic()
        try:
            state = await self.compute(self._prepare, call)
            if call.resume is not None:
                try:
                    await self.compute(self.runner.restore, state, call.resume)
                except BaseException:
                    self.runner.release(state)
                    raise
        finally:
            self._admitting -= 1
            self._wake.set()
        job = Job(call, state, self.runner.step_cost(state), called=called)
        job.waiting = tracing.start(
            "queue wait", attributes={"omnistage.queue": self.name, "omnistage.queued": len(self.jobs)}
        )
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
            job.end_wait()  # (gone before its first step)
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

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        in_flight: Launched | None = None  # launched, not yet reported (overlap)
        while True:
            jobs, plan = list(self.jobs), self._plan()
            self._drop(jobs, plan)
            if await self._release_left(in_flight):
                continue  # jobs may have come or changed meanwhile: plan again
            batch = [jobs[i] for i in plan.batch]
            if in_flight is None and plan.wait_s > 0:  # wait for company, then plan again
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), plan.wait_s)
                continue
            launched = await self._launch(batch) if batch else None
            if in_flight is not None:
                await self._complete(in_flight)
            in_flight = launched
            if launched is not None and (launched.wait or not (self.overlap or launched.answers_late)):
                await self._complete(launched)
                in_flight = None
            if in_flight is not None or batch:
                continue
            self._wake.clear()
            if not self.jobs:
                if await self._idle_work():
                    continue
                await self._wake.wait()
            else:  # every job waits for input: check deadlines now and then
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_CHECK_S)

    async def _idle_work(self) -> bool:
        """One unit of the runner's idle work (HasIdleWork: e.g. a CUDA graph of a common shape
        captured ahead) while no request is here or being admitted; True when it did some. A
        request that arrives meanwhile waits for that one unit at most."""
        runner = self.runner
        if not isinstance(runner, HasIdleWork) or self.jobs or self._admitting or not self._idle_ok:
            return False
        try:
            done = bool(await self.compute(runner.idle_work))
        except Exception:
            log.exception("%s: idle work failed; no more of it", self.name)
            self._idle_ok = False
            self._count_idle_work()  # none left: none will run (a caller waiting on it goes on)
            return False
        self._count_idle_work()
        return done

    def _count_idle_work(self) -> None:
        runner = self.runner
        left = runner.idle_work_left() if isinstance(runner, HasIdleWork) else 0
        self.totals.idle_work_left = left if self._idle_ok else 0

    def _plan(self) -> StepPlan:
        """step_policy's plan for the jobs as they are now."""
        return plan_step(
            [self._queued(job) for job in self.jobs],
            self.limits,
            now=time.monotonic(),
            admitting=self._admitting,
            streaming=self.streaming is not None,
        )

    def _queued(self, job: Job) -> Queued:
        ready = not job.gone and self._ready(job)
        return Queued(
            key=self.runner.batch_key(job.state) if ready else None,
            cost=job.cost,
            admitted=job.admitted,
            ready=ready,
            step_index=job.state.step_index,
            last_step=job.last_step,
            followers=job.call.followers,
            deadline=job.call.deadline,
            gone=job.gone,
        )

    def _drop(self, jobs: list[Job], plan: StepPlan) -> None:
        """Jobs whose caller went away leave; jobs past their deadline fail with DEADLINE_EXCEEDED."""
        expired = set(plan.expired)
        for i in sorted((*plan.gone, *plan.expired)):
            job = jobs[i]
            self.jobs.remove(job)
            self._left.append(job.state)
            if i in expired:
                job.events.put_nowait(
                    DeadlineExceeded(
                        f"request {job.call.request_id}: the deadline passed at step "
                        f"{job.state.step_index}/{job.state.total_steps}; dropped before more compute"
                    )
                )

    def _ready(self, job: Job) -> bool:
        """Not finished by a launched step (its report may be pending) and, streaming, its
        input there."""
        if job.finishing:
            return False
        return self.streaming is None or self.streaming.ready(job.state)

    async def _launch(self, batch: list[Job]) -> Launched | None:
        """Launch one step for `batch`; a step that fails is retried job by job, so one bad
        request fails alone. None when no job stepped."""
        for job in batch:
            job.end_wait()
        try:
            return await self.compute(advance, self.runner, batch, self.streaming, self.timed)
        except Unavailable as lost:  # the replica cannot step at all (a device worker died)
            for job in batch:
                self._retire(job, lost)
            return None
        except Exception:
            if len(batch) == 1:
                self._fail(batch[0])
                return None
            log.warning("a step of %d requests failed; retrying them one by one", len(batch))
            parts = [await self._launch([job]) for job in batch]
            return joined([part for part in parts if part is not None])

    async def _complete(self, launched: Launched) -> None:
        """Wait for a launched step to end on the device, then report it: NaN checks,
        progress, finished requests."""
        try:
            if launched.end is not None:
                await asyncio.to_thread(launched.end.synchronize)
            if launched.answers_late:
                await self.compute(launched.read_late_flags)
            self.step_ms = self._account(launched)
        except Exception:  # the device failed the step (an asynchronous CUDA error, a rank's error)
            for job in launched.jobs:
                if job in self.jobs:
                    self._fail(job)
            return
        self.batch_sizes = [*self.batch_sizes[-99:], len(launched.jobs)]
        now = time.monotonic()
        for i, job in enumerate(launched.jobs):
            if job not in self.jobs:  # failed, cancelled or expired since the launch
                continue
            if not bool(launched.finite[i]):
                log.error("request %s: the step produced NaN or Inf", job.call.request_id)
                self._retire(
                    job, OmniError(f"request {job.call.request_id}: {self.name} produced NaN or Inf")
                )
                continue
            job.last_step = now
            job.steps_ms.append(self.step_ms)
            job.batches.append(len(launched.jobs))
            try:
                await self._report(job, launched, i)
            except Exception:  # a fault of the scheduler itself: fail the job, keep serving
                self._fail(job)

    def _account(self, launched: Launched) -> float:
        """The step's duration in ms (device time on a GPU), added to the totals."""
        totals = self.totals
        totals.steps += 1
        if launched.start is None or launched.end is None:
            # Since its launch, or since the step before it was reported where it was launched
            # before that (answers_late): its share of the time, not the two steps in flight.
            now, since = time.perf_counter(), max(launched.started_at, self._last_reported_at)
            self._last_reported_at = now
            return (now - since) * 1e3
        device_ms = launched.start.elapsed_time(launched.end)
        totals.device_s += device_ms / 1e3
        # Idle time counts between two steps of one running request: the gap before a new
        # request's first step is waiting for work, not a step's cost.
        jobs = {id(job) for job in launched.jobs}
        if self._last_end is not None and jobs & self._last_jobs:
            totals.idle_s += max(self._last_end.elapsed_time(launched.start), 0.0) / 1e3
        self._last_end, self._last_jobs = launched.end, jobs
        return device_ms

    def _fail(self, job: Job) -> None:
        lost = sys.exc_info()[1]
        if isinstance(lost, Unavailable):  # the caller moves the request to another replica
            self._retire(job, lost)
            return
        log.exception("request %s: %s step failed", job.call.request_id, self.name)
        self._retire(job, OmniError(f"internal error in {self.name} (request {job.call.request_id})"))

    def _retire(self, job: Job, event: Event) -> None:
        if job in self.jobs:
            self.jobs.remove(job)
            self._left.append(job.state)
        job.events.put_nowait(event)

    async def _release_left(self, in_flight: Launched | None) -> bool:
        """Free what unfinished jobs held (a KV slot), between steps: no step uses them then
        (a state in the step still on the device waits for the next round). True when it
        released any (it waited for the compute thread)."""
        busy = {id(job.state) for job in in_flight.jobs} if in_flight is not None else set()
        free = [state for state in self._left if id(state) not in busy]
        for state in free:
            self._left.remove(state)
            try:
                await self.compute(self.runner.release, state)
            except Exception:
                log.exception("%s: releasing a request's state failed", self.name)
        return bool(free)

    async def _report(self, job: Job, launched: Launched, i: int) -> None:
        """Progress after the launched step of `job`, its i-th (its chunk, checkpoint, preview
        as due), then its result if that was its last step."""
        state, call = job.state, job.call
        done, checkpoint, step_ms = launched.done[i], launched.checkpoints[i], self.step_ms
        every = max(call.progress_every, 1)
        partial, job.partial = job.partial, None
        if partial is not None and not job.first_chunk:
            job.first_chunk = time.monotonic()
        if self.chunked is not None and self.chunked.is_prefilling(state):
            return  # its step prefilled a chunk of its prompt: no token, nothing to report yet
        if done % every == 0 or done == state.total_steps or checkpoint is not None or partial is not None:
            progress = Progress(step=done, total=state.total_steps, step_ms=step_ms, partial=partial)
            if launched.previews[i]:  # its step was completed before the next launch
                progress.preview_png = await self.compute(preview_png, self.runner, state)
            progress.checkpoint = checkpoint
            job.events.put_nowait(progress)
        if launched.finished[i]:
            self.jobs.remove(job)
            log_steps(self.name, job)
            try:
                result = await self.compute(self.runner.finish, state)
            except Exception:
                self._fail(job)
                return
            if (together := sum(launched.finished)) > 1:
                result.meta[FINISHED_WITH] = str(together - 1)
            job.events.put_nowait(result)
