"""One request's plan in flight: which steps run, in what order, and when an output's leases end.

`PlanRun.result` reads as the recipe: produce the result step, which first produces the steps
it consumes, and so on, steps that do not depend on each other at the same time. Each output is
released once every step that reads it has finished; a step whose inputs were lost produces
them again (seeded steps give the same tensors). The calls themselves are RequestFlow's
(flow.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from omni_common.errors import NotFound, Unavailable
from omni_common.models.base import Plan, PlanStep
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import tensor_pb2
from services.coordinator.output_cache import CachedOutput, StepOutputCache
from services.coordinator.registry import ReplicaPool
from services.coordinator.request import FlowRequest, StepOutput
from services.coordinator.step_streams import Stream

log = logging.getLogger("omnistage.coordinator")

RECOMPUTES = 2  # times a step's lost inputs are produced again before the request fails


class StageCalls(Protocol):
    """What a plan run needs of the coordinator's stage calls (`flow.RequestFlow`)."""

    def result_outputs(self, options: cpb.GenerateRequest) -> list[str]:
        """The tensors the result step returns, in the client's format."""
        ...

    async def run_step(
        self,
        req: FlowRequest,
        step: PlanStep,
        inputs: tensor_pb2.StageState,
        *,
        near: str,
        then: PlanStep | None,
        outputs: list[str],
        stream_in: Stream | None = None,
    ) -> StepOutput:
        """Run `step` on its best replica, moving on when one is lost."""
        ...


class PlanRun:
    """One request's plan in flight: each step's output is produced once, on demand, by a task
    that first awaits the outputs it consumes (so independent steps run concurrently). `calls`
    runs the stage calls, `pool` says which roles have replicas, `cache` keeps reusable outputs."""

    def __init__(
        self,
        req: FlowRequest,
        plan: Plan,
        *,
        calls: StageCalls,
        pool: ReplicaPool,
        cache: StepOutputCache,
    ) -> None:
        self.calls = calls
        self.pool = pool
        self.cache = cache
        self.req = req
        self.plan = plan
        self._tasks: dict[str, asyncio.Task[StepOutput]] = {}
        self._pinned: list[CachedOutput] = []
        # Steps that read each step's output in this run (decided up front, cache hits
        # included): when all of them have finished, the output's leases are released.
        self._readers = self._count_readers()

    async def result(self) -> StepOutput:
        return await self._output(self.plan.result)

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for entry in self._pinned:
            self.cache.unpin(entry)
        self._pinned.clear()

    def _count_readers(self) -> dict[str, int]:
        readers: dict[str, int] = {}
        needed: set[str] = set()
        stack = [self.plan.result]
        while stack:
            step = stack.pop()
            if step.name in needed:
                continue
            needed.add(step.name)
            if step.cache_key and self.cache.peek(self._cache_key(step)):
                continue
            for producer in self._producers(step):
                readers[producer.name] = readers.get(producer.name, 0) + 1
                stack.append(producer)
        return readers

    def _producers(self, step: PlanStep) -> list[PlanStep]:
        found: list[PlanStep] = []
        for name in step.consumes:
            producer = self.plan.producer(name)
            if producer is not None and producer not in found:
                found.append(producer)
        return found

    def _output(self, step: PlanStep) -> asyncio.Task[StepOutput]:
        task = self._tasks.get(step.name)
        if task is None:
            task = self._tasks[step.name] = asyncio.ensure_future(self._produce_and_end(step))
        return task

    async def _produce_and_end(self, step: PlanStep) -> StepOutput:
        """Produce `step`'s output; its stream (if it streams) ends with it, or fails with it."""
        stream = self.req.stream(step.name)
        try:
            output = await (self._produce_streaming(step) if step.streamed else self._produce(step))
        except Exception as err:
            stream.fail(err)
            raise
        except asyncio.CancelledError:
            stream.fail(Unavailable(f"request {self.req.request_id}: {step.name} was cancelled"))
            raise
        stream.end()
        return output

    def _wanted(self, step: PlanStep) -> list[str]:
        """The outputs to ask of `step`: the image in the client's format from an image result."""
        if step is self.plan.result and "image" in step.produces:
            return self.calls.result_outputs(self.req.options)
        return []

    async def _produce_streaming(self, step: PlanStep) -> StepOutput:
        """A step that takes an input as a stream: it starts once the stream's first chunk exists
        (its producer runs meanwhile) and its other inputs are whole, and is fed the rest as it
        comes. A stream is not produced again: one lost with its producer fails the request."""
        source = self.plan.producer(step.streamed[0])
        assert source is not None
        stream = self.req.stream(source.name)
        source_task = self._output(source)
        whole = [p for p in self._producers(step) if p is not source]
        outputs = list(await asyncio.gather(*(self._output(p) for p in whole)))
        inputs = self._inputs(step, outputs)
        if await stream.wait(1):
            inputs.tensors.extend(stream.chunks[0].tensors)
            inputs.meta.update(stream.chunks[0].meta)
        near = self._near_host(outputs)
        producer = self.pool.by_address(stream.producer)
        if producer is not None and producer.info is not None:
            near = producer.info.host_id
        then = next(iter(self.plan.consumers(step)), None)
        output = await self.calls.run_step(
            self.req, step, inputs, near=near, then=then, outputs=self._wanted(step), stream_in=stream
        )
        for o in [*outputs, await source_task]:
            self._read_done(o)
        return output

    async def _produce(self, step: PlanStep) -> StepOutput:
        cached = self._from_cache(step)
        if cached is not None:
            finished = cpb.StageFinished(stage=step.stage, step=step.name, cached=True)
            await self.req.emit(cpb.GenerateEvent(stage_finished=finished))
            return cached
        for attempt in range(RECOMPUTES + 1):
            outputs = await self._inputs_ready(step)
            inputs = self._inputs(step, outputs)
            near = self._near_host(outputs)
            then = next(iter(self.plan.consumers(step)), None)
            try:
                output = await self.calls.run_step(
                    self.req, step, inputs, near=near, then=then, outputs=self._wanted(step)
                )
            except NotFound:
                lost = [o for o in outputs if self._lost(o)]
                if not lost:  # a producer killed a moment ago may not be known dead yet
                    alive = await asyncio.gather(*(self.pool.probe(o.producer) for o in outputs))
                    lost = [o for o, up in zip(outputs, alive, strict=True) if not up]
                if not lost or attempt == RECOMPUTES:
                    raise
                names = ", ".join(o.step.name for o in lost)
                log.warning(
                    "request %s: inputs of %s are gone; producing %s again",
                    self.req.request_id,
                    step.name,
                    names,
                )
                for o in lost:
                    self._forget(o)
                continue
            self._store(step, output)
            for o in outputs:
                self._read_done(o)
            return output
        raise AssertionError("unreachable")

    async def _inputs_ready(self, step: PlanStep) -> list[StepOutput]:
        """The outputs `step` reads, produced again where one was already released (a step
        that runs again after its inputs' readers had finished)."""
        while True:
            outputs = await asyncio.gather(*(self._output(p) for p in self._producers(step)))
            released = [o for o in outputs if o.released]
            if not released:
                return list(outputs)
            for output in released:
                self._forget(output)

    def _cache_key(self, step: PlanStep) -> str:
        """The family's content key, within the model (other weights give other outputs)."""
        return f"{self.req.params.model}|{step.name}|{step.cache_key}"

    def _from_cache(self, step: PlanStep) -> StepOutput | None:
        if not step.cache_key:
            return None
        entry = self.cache.get(self._cache_key(step), step.name)
        if entry is None:
            return None
        self._pinned.append(entry)
        return StepOutput(step, entry.producer, entry.state, cached=entry)

    def _store(self, step: PlanStep, output: StepOutput) -> None:
        """A cacheable step's fresh output goes to the cache, which takes over its leases."""
        if not step.cache_key:
            return
        entry = self.cache.put(self._cache_key(step), step.name, output.producer, output.state)
        if entry is not None:
            self.req.leases.take(output.producer, output.state)
            self._pinned.append(entry)
            output.cached = entry

    def _lost(self, output: StepOutput) -> bool:
        """Whether an input may be gone: a cached one (its leases may have expired), one we
        released, or one whose producer is no longer alive."""
        return output.cached is not None or output.released or not self.pool.is_alive(output.producer)

    def _forget(self, output: StepOutput) -> None:
        """Drop a lost output so the next demand produces it again."""
        if output.cached is not None:
            self.cache.invalidate(output.cached)
        elif not output.released:
            self.req.leases.drop(output.producer, output.state)
        self._tasks.pop(output.step.name, None)
        self._readers.pop(output.step.name, None)  # released when the request ends

    def _read_done(self, output: StepOutput) -> None:
        """One reader of `output` finished; the last one releases its leases."""
        name = output.step.name
        if name not in self._readers:
            return
        self._readers[name] -= 1
        if self._readers[name] == 0 and output.cached is None and not output.released:
            output.released = True
            self.req.leases.drop(output.producer, output.state)

    def _inputs(self, step: PlanStep, outputs: list[StepOutput]) -> tensor_pb2.StageState:
        """The handles of the tensors `step` consumes, gathered from their producers' outputs
        (metadata merged in plan order); request inputs are added per call."""
        state = tensor_pb2.StageState()
        wanted = set(step.consumes)
        for output in outputs:
            state.meta.update(output.state.meta)
            state.tensors.extend(ref for ref in output.state.tensors if ref.name in wanted)
        return state

    def _near_host(self, outputs: list[StepOutput]) -> str:
        """The host of the largest input: where the next call should run if it can."""
        best, host = -1, ""
        for output in outputs:
            size = sum(ref.nbytes for ref in output.state.tensors)
            replica = self.pool.by_address(output.producer)
            if size > best and replica is not None and replica.info is not None:
                best, host = size, replica.info.host_id
        return host
