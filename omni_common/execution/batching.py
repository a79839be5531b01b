"""Micro-batching for stages whose work is one forward per batch (encoder, VAE).

Concurrent submissions are queued; whenever the runner is free, everything queued (up to
`max_batch` items and `max_cost` of their `cost`, after waiting `window_s` for company) runs
as one batch. With window 0 a
lone request pays no added latency, and requests that arrive while a batch runs form the
next one. A request that says others are moments behind it (`followers`: requests that left
the previous stage in the same step, StepScheduler's FINISHED_WITH) waits for them, at most
FOLLOWERS_WAIT_S: otherwise the first of a burst runs alone and the rest queue behind it (on
an H200, 8 images finished by one DiT step decoded as 1 then 7: 219 ms for the last, 138 ms
as one batch). The queue is bounded: a full queue is RESOURCE_EXHAUSTED with a retry hint.
One failing item never fails its batch: the batch is retried item by item.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from omni_common.errors import DeadlineExceeded, OmniError, ResourceExhausted
from omni_common.net import tracing
from omni_common.stages import MAX_BATCH, MAX_QUEUE

I = TypeVar("I")  # noqa: E741
O = TypeVar("O")  # noqa: E741
log = logging.getLogger("omnistage.batching")
# How long a batch waits for the followers its first request announced: they left the
# previous stage with it, so they come within milliseconds, or not soon.
FOLLOWERS_WAIT_S = 0.025


@dataclass(eq=False)
class _Pending(Generic[I, O]):
    item: I
    future: asyncio.Future[O]
    deadline: float | None
    label: str
    followers: int = 0  # requests moments behind this one (submit's `followers`)
    waiting: Any = tracing.NO_SPAN  # the request's wait in the queue (tracing.start)

    def end_wait(self) -> None:
        self.waiting.end()
        self.waiting = tracing.NO_SPAN


class MicroBatcher(Generic[I, O]):
    def __init__(
        self,
        run_batch: Callable[[list[I]], Awaitable[list[O]]],
        *,
        name: str,
        window_s: float = 0.0,
        max_batch: int = MAX_BATCH,
        max_queue: int = MAX_QUEUE,
        cost: Callable[[I], int] = lambda item: 1,
        max_cost: int = 0,
    ) -> None:
        self.run_batch = run_batch
        self.name = name
        self.window_s = window_s
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.cost = cost
        self.max_cost = max_cost  # 0: no limit; a batch always takes at least one item
        self.queue: deque[_Pending[I, O]] = deque()
        self.batch_ms = 0.0  # duration of the last batch, for retry hints
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self.queue)

    async def submit(
        self, item: I, *, deadline: float | None = None, label: str = "", followers: int = 0
    ) -> O:
        """Queue `item` and wait for its result (cancelling the wait drops the item);
        `followers`: requests for this batcher moments behind it, worth waiting for."""
        if len(self.queue) >= self.max_queue:
            wait_ms = max(1, round(self.batch_ms * (len(self.queue) / self.max_batch + 1)))
            raise ResourceExhausted(
                f"{self.name} is at capacity ({len(self.queue)} requests queued); "
                f"retry in about {wait_ms} ms",
                retry_after_ms=wait_ms,
            )
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        future: asyncio.Future[O] = asyncio.get_running_loop().create_future()
        waiting = tracing.start(
            "queue wait", attributes={"omnistage.queue": self.name, "omnistage.queued": len(self.queue)}
        )
        pending = _Pending(item, future, deadline, label, followers, waiting)
        self.queue.append(pending)
        self._wake.set()
        try:
            return await future
        finally:
            pending.end_wait()  # left the queue without a batch (cancelled, deadline)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
            await self._await_followers()
            if self.window_s > 0 and len(self.queue) < self.max_batch:
                await asyncio.sleep(self.window_s)
            batch = self._take()
            if batch:
                started = time.perf_counter()
                await self._run(batch)
                self.batch_ms = (time.perf_counter() - started) * 1e3

    async def _await_followers(self) -> None:
        """Wait, at most FOLLOWERS_WAIT_S, until the followers the queue's first request
        announced (or a full batch) are queued too."""
        wanted = min(1 + self.queue[0].followers, self.max_batch)
        until = time.monotonic() + FOLLOWERS_WAIT_S
        while self.queue and len(self.queue) < wanted and (left := until - time.monotonic()) > 0:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def _take(self) -> list[_Pending[I, O]]:
        batch: list[_Pending[I, O]] = []
        now = time.monotonic()
        cost = 0
        while self.queue and len(batch) < self.max_batch:
            if batch and self.max_cost and cost + self.cost(self.queue[0].item) > self.max_cost:
                break
            pending = self.queue.popleft()
            if pending.future.done():  # cancelled while queued
                continue
            if pending.deadline is not None and now >= pending.deadline:
                pending.future.set_exception(
                    DeadlineExceeded(f"{self.name}: the deadline passed while the request was queued")
                )
                continue
            batch.append(pending)
            pending.end_wait()
            cost += self.cost(pending.item)
        return batch

    async def _run(self, batch: list[_Pending[I, O]]) -> None:
        try:
            results = await self.run_batch([p.item for p in batch])
        except Exception as err:
            if len(batch) == 1:
                if isinstance(err, OmniError):  # the request's own fault: say so
                    if not batch[0].future.done():
                        batch[0].future.set_exception(err)
                else:
                    _fail(batch[0], self.name)
                return
            log.warning("%s: a batch of %d failed; retrying its items one by one", self.name, len(batch))
            for pending in batch:
                await self._run([pending])
            return
        for pending, result in zip(batch, results, strict=True):
            if not pending.future.done():
                pending.future.set_result(result)


def _fail(pending: _Pending[I, O], name: str) -> None:
    log.exception("%s: request %s failed", name, pending.label or "?")
    if not pending.future.done():
        pending.future.set_exception(OmniError(f"internal error in {name} (request {pending.label or '?'})"))
