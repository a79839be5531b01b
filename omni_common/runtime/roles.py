"""How a stage replica drives each role runner of its stage model.

A role's runner kind (omni_common.models.base) decides its handler:
- `BatchRunner` -> micro-batched on the compute thread (whatever is queued when the model is
  free runs as one batch, bounded by the stage's batch size and cost budget);
- `StepRunner` -> a StepScheduler: continuous batching between steps;
- `AsyncRunner` -> called directly (it queues and batches by itself).
Every handler streams a call's progress (step-wise roles) and then its one output.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import torch

from omni_common.execution.batching import MicroBatcher
from omni_common.models.base import (
    AsyncRunner,
    BatchRunner,
    RoleCall,
    RoleSpec,
    StageState,
    StepRunner,
)
from omni_common.models.capabilities import PrefillsInChunks, SupportsPrefixCache
from omni_common.runtime.calls import Progress, StageCall
from omni_common.runtime.step_scheduler import Compute, StepScheduler, StepTotals
from omni_common.stages import MAX_BATCH, MAX_QUEUE


@dataclass(frozen=True)
class RoleLimits:
    """The stage's batching flags, as every handler of the replica applies them."""

    max_batch: int = MAX_BATCH
    max_queue: int = MAX_QUEUE
    batch_window_s: float = 0.0
    max_step_cost: int = 65536  # StepScheduler: compute units per step (--max-tokens)
    max_batch_cost: int = 0  # MicroBatcher: cost units per batch, 0 = none (--max-batch-pixels)


class RoleHandler(Protocol):
    streams: bool  # takes streamed inputs (a streaming step-wise role)

    def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]: ...

    def load(self) -> int:
        """Work waiting or running: the role's share of the stage's load signal."""
        ...

    def close(self) -> None: ...


class BatchRole:
    """A BatchRunner behind a MicroBatcher on the compute thread."""

    streams = False

    def __init__(self, name: str, runner: BatchRunner, compute: Compute, limits: RoleLimits) -> None:
        self.runner = runner
        self.compute = compute
        self.pending = 0  # cost of the calls queued or running
        self.batcher: MicroBatcher[RoleCall, StageState] = MicroBatcher(
            self._run_batch,
            name=name,
            window_s=limits.batch_window_s,
            max_batch=limits.max_batch,
            max_queue=limits.max_queue,
            cost=runner.cost,
            max_cost=limits.max_batch_cost,
        )

    async def _run_batch(self, calls: list[RoleCall]) -> list[StageState]:
        return await self.compute(self.runner.run_batch, calls)

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        role_call = call.role_call()
        cost = self.runner.cost(role_call)
        self.pending += cost
        try:
            yield await self.batcher.submit(
                role_call, deadline=call.deadline, label=call.request_id, followers=call.followers
            )
        finally:
            self.pending -= cost

    def load(self) -> int:
        return self.pending

    def close(self) -> None:
        self.batcher.close()


class StepRole:
    """A StepRunner behind a StepScheduler (on a GPU it overlaps steps: step_scheduler)."""

    def __init__(
        self, name: str, runner: StepRunner, compute: Compute, limits: RoleLimits, device: torch.device
    ) -> None:
        self.scheduler = StepScheduler(
            runner,
            compute,
            max_batch=limits.max_batch,
            max_tokens=limits.max_step_cost,
            max_queue=limits.max_queue,
            name=name,
            device=device,
            batch_window_s=limits.batch_window_s,
        )
        self.streams = self.scheduler.streaming is not None  # takes streamed inputs

    def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        return self.scheduler.run(call)

    def load(self) -> int:
        """Remaining steps times their cost, over every request here."""
        return self.scheduler.queued_work()

    @property
    def totals(self) -> StepTotals:
        totals = self.scheduler.totals
        runner = self.scheduler.runner
        if isinstance(runner, SupportsPrefixCache):  # read when metrics are scraped
            stats = runner.prefix_stats()
            totals.prefix_hits, totals.prefix_misses, totals.prefix_bytes = (
                stats.hits,
                stats.misses,
                stats.bytes,
            )
        if isinstance(runner, PrefillsInChunks):
            totals.prefill_chunks = runner.prefill_chunks()
        return totals

    def close(self) -> None:
        self.scheduler.close()


class AsyncRole:
    """An AsyncRunner, called directly."""

    streams = False

    def __init__(self, runner: AsyncRunner) -> None:
        self.runner = runner

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        yield await self.runner.run(call.role_call())

    def load(self) -> int:
        return self.runner.load()

    def close(self) -> None:
        self.runner.close()


def role_handler(
    spec: RoleSpec, runner: object, compute: Compute, limits: RoleLimits, device: torch.device
) -> RoleHandler:
    """The handler of one role, by the kind its family declares."""
    if spec.kind == "batch":
        return BatchRole(spec.name, runner, compute, limits)  # type: ignore[arg-type]
    if spec.kind == "steps":
        return StepRole(spec.name, runner, compute, limits, device)  # type: ignore[arg-type]
    return AsyncRole(runner)  # type: ignore[arg-type]
