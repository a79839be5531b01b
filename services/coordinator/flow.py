"""One request through its model's plan, handles only.

A family's plan (omni_common.models.base.Plan) lists the role calls of a request with the
tensors each consumes and produces; `PlanRun.result` (plan_run.py) reads as the recipe:
produce the result step, which first produces the steps it consumes, and so on, each on the
least-loaded replica that serves its role (this file's RequestFlow), steps that do not depend
on each other at the same time. Stage outputs
stay in the producing stage's arena; this code passes their handles on and releases each
output's leases once every step that reads it has finished, and everything of a request that
fails or is cancelled.

Replicas may die. A call is retried on another replica. A resumable step (denoising) sends a
checkpoint every few steps and resumes on another replica from the latest one (or from the
start if that checkpoint is gone); the result equals the uninterrupted one. A checkpoint is
the one tensor this process copies: it must outlive its replica, and a deleted pod takes its
/dev/shm along, so its bytes move into this process's own store (about 1 MiB at 1024x1024,
every few steps) and the replica's lease ends at once. When a step's
inputs are gone (their producer died, or a cached output expired), the steps that produced
them run again: seeded steps give the same tensors, so the image is the same.

Some steps stream (step_streams.py): their outputs leave in chunks while they run, a step that
takes them as a stream starts with the first chunk and is fed the rest, and the result step's
chunks go to the client as they come (AudioChunk), as does text any step writes (TextDelta).
The result event is results.py's; what a failed call means (a replica lost or the request's
own error) is failures.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import torch

from omni_common.errors import NotFound, OmniError, Unavailable
from omni_common.input_media import INPUT_PREFIX
from omni_common.models.base import Plan, PlanStep
from omni_common.net import tracing
from omni_common.runtime.calls import finished_with
from omni_common.transport import Consumer, TensorTransport
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.affinity import PrefixRoutes
from services.coordinator.failures import ReplicaLost, stage_failure
from services.coordinator.leases import Leases, release_later
from services.coordinator.offload import SwapPolicy
from services.coordinator.output_cache import StepOutputCache
from services.coordinator.plan_run import PlanRun
from services.coordinator.prefix_move import PrefixMoves, with_prefix
from services.coordinator.registry import Replica, ReplicaPool
from services.coordinator.request import Emit, FlowRequest, StepOutput
from services.coordinator.results import result_outputs, send_audio, send_result
from services.coordinator.step_streams import Stream, feed

log = logging.getLogger("omnistage.coordinator")

ATTEMPTS = 3  # replicas tried per step before the request fails
REPLICA_POLL_S = 0.2  # while a request waits for a replica: how often the pool is looked at
TOKEN_PROGRESS_EVERY = 16  # tokens between two TokenProgress events


class RequestFlow:
    """Runs requests over a ReplicaPool; one instance per coordinator."""

    def __init__(
        self,
        pool: ReplicaPool,
        transport: TensorTransport,
        stage_timeout_s: float,
        checkpoint_every: int = 5,
        offload: SwapPolicy | None = None,
        cache: StepOutputCache | None = None,
        replica_wait_s: float = 0.0,
        routes: PrefixRoutes | None = None,
        moves: PrefixMoves | None = None,
    ) -> None:
        self.pool = pool
        self.routes = routes if routes is not None else PrefixRoutes(0)
        self.moves = moves or PrefixMoves(pool, transport, 0.0, stage_timeout_s)  # 0: never move
        self.replica_wait_s = replica_wait_s
        self.offload = offload
        self.transport = transport
        self.stage_timeout_s = stage_timeout_s
        self.checkpoint_every = checkpoint_every
        # (not `cache or ...`: an empty cache has len 0, so it is falsy)
        self.cache = cache if cache is not None else StepOutputCache(transport, max_bytes=0, max_age_s=0.0)
        # Requests in each plan step now, by (request shape, step name): a step-wise call is told
        # how many requests like its own are still in the steps before it (followers).
        self.in_step: Counter[tuple[tuple[object, ...], str]] = Counter()

    async def run(
        self,
        request_id: str,
        params: stage_pb2.GenerationParams,
        options: cpb.GenerateRequest,
        plan: Plan,
        deadline: float | None,
        emit: Emit,
        media: dict[str, bytes] | None = None,
    ) -> None:
        """Run one validated request's plan; `options` gives the result's format and progress
        rate, `deadline` (time.monotonic()) the client's deadline, which every call carries."""
        started = time.perf_counter()
        req = FlowRequest(
            request_id=request_id,
            params=params,
            options=options,
            deadline=deadline,
            emit=emit,
            leases=Leases(self.transport),
            media=media or {},
            plan=plan,
        )
        run = PlanRun(req, plan, calls=self, pool=self.pool, cache=self.cache)
        try:
            result = await run.result()
            await send_result(self.transport, req, plan.result, result.state, started)
        finally:
            run.close()
            req.leases.release_all()

    def result_outputs(self, options: cpb.GenerateRequest) -> list[str]:
        return result_outputs(options)

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
        """Run `step` on its best replica (near the inputs' host), moving on when one is lost.
        The output's handles suit `then`'s likely replica (CUDA IPC on its GPU, shm on its
        host, else fetch); without `then`, this process, which has no GPU, consumes it."""
        with self._counted(req, step):
            tried: set[str] = set()
            model = req.params.model
            holder = self.routes.holder(model, step.prefixes)  # before _replica_for forgets it
            for _ in range(ATTEMPTS):
                replica = await self._replica_for(req, step, near, frozenset(tried))
                source, holder = holder, ""  # one move a step
                moved = await self.moves.fetch(req, step, source, replica, inputs, self._export_media)
                consumer = Consumer(self.transport.host_id)
                # Outputs suit the next step's likely replica; with none now (one restarting) they
                # suit this process, which any replica can fetch from.
                if then is not None and self.pool.serving(then.stage, model, then.role):
                    assert replica.info is not None
                    info = self.pool.pick(
                        then.stage, model, role=then.role, near_host=replica.info.host_id
                    ).info
                    if info is not None:
                        consumer = Consumer(info.host_id, info.ipc_namespace, info.gpu_uuid)
                try:
                    joined = with_prefix(inputs, moved)
                    state = await self._call(req, step, replica, joined, consumer, outputs, stream_in)
                    self.routes.remember(model, step.prefixes, replica.address)
                    return StepOutput(step, replica.address, state)
                except ReplicaLost as lost:
                    tried.add(replica.address)
                    self.routes.forget(replica.address)
                    req.failovers.append(replica.address)
                    others = [
                        r for r in self.pool.serving(step.stage, model, step.role) if r.address not in tried
                    ]
                    if lost.own_error is not None and not others:
                        raise lost.own_error from None
                    log.warning("request %s: %s; moving on", req.request_id, lost.message)
                except NotFound:
                    if moved is not None:  # its holder's leases ended first: the prefix is computed
                        log.warning("request %s: the moved prefix is gone", req.request_id)
                        continue
                    if step.name not in req.checkpoints:
                        raise
                    log.warning(
                        "request %s: %s checkpoint gone; restarting the step", req.request_id, step.name
                    )
                    req.leases.drop(*req.checkpoints.pop(step.name))
                finally:
                    if moved is not None:  # read by the call now, or never
                        req.leases.drop(source, moved)
            raise Unavailable(
                f"request {req.request_id}: no {step.stage} replica could finish {step.name}; retry later"
            )

    @contextlib.contextmanager
    def _counted(self, req: FlowRequest, step: PlanStep) -> Iterator[None]:
        """`req` counts in `step`'s in_step while the block runs."""
        key = (req.shape, step.name)
        self.in_step[key] += 1
        try:
            yield
        finally:
            self.in_step[key] -= 1
            if not self.in_step[key]:
                del self.in_step[key]

    def followers(self, req: FlowRequest, step: PlanStep) -> int:
        """Requests of `req`'s shape now in the steps that produce `step`'s inputs: they will
        likely reach `step`'s stage within moments (a burst of requests encoded in waves)."""
        before = {p.name for name in step.consumes if (p := req.plan.producer(name)) is not None}
        return sum(self.in_step.get((req.shape, name), 0) for name in before)

    async def _replica_for(
        self, req: FlowRequest, step: PlanStep, near: str, tried: frozenset[str]
    ) -> Replica:
        """The best healthy replica for `step`, not one this request lost already. With none,
        the request waits for one (a restarted replica registers again, a new one joins) for
        up to `replica_wait_s` within its deadline, and says so in a WaitingForReplica event;
        a replica lost earlier is taken again once it has re-registered (it restarted)."""
        model = req.params.model
        loras = frozenset(ref.name for ref in req.params.loras)
        usable = {r.address for r in self.pool.serving(step.stage, model, step.role)} - tried
        prefer = self.routes.preferred(model, step.prefixes, usable)
        try:
            replica = self.pool.pick(
                step.stage, model, role=step.role, near_host=near, avoid=tried, loras=loras, prefer=prefer
            )
            self.routes.count(step.prefixes, prefer, replica.address)
            return replica
        except Unavailable:
            if self.replica_wait_s <= 0:
                raise
        bound = time.monotonic() + self.replica_wait_s
        until = bound if req.deadline is None else min(bound, req.deadline)
        log.warning(
            "request %s: no healthy %s replica for %s; waiting", req.request_id, step.stage, step.name
        )
        waiting = cpb.WaitingForReplica(
            stage=step.stage, role=step.role, step=step.name, max_wait_ms=round(self.replica_wait_s * 1e3)
        )
        await req.emit(cpb.GenerateEvent(waiting=waiting))
        with tracing.span(f"wait for a {step.stage} replica", **{"omnistage.step": step.name}):
            while time.monotonic() < until:
                await asyncio.sleep(REPLICA_POLL_S)
                if self.pool.serving(step.stage, model, step.role):
                    return self.pool.pick(step.stage, model, role=step.role, near_host=near, loras=loras)
        req.timeout(self.stage_timeout_s)  # DEADLINE_EXCEEDED when that is what ended the wait
        raise Unavailable(
            f"request {req.request_id}: no healthy {step.stage} replica for {step.name} "
            f"within {self.replica_wait_s:g} s; retry later"
        )

    async def _call(
        self,
        req: FlowRequest,
        step: PlanStep,
        replica: Replica,
        inputs: tensor_pb2.StageState,
        consumer: Consumer,
        outputs: list[str],
        stream_in: Stream | None = None,
    ) -> tensor_pb2.StageState:
        """Run one stage call; returns its output handles (their leases are booked in req.leases).
        With `stream_in`, `inputs` holds its first chunk and a feeder sends the rest."""
        where = {
            "omnistage.stage": replica.stage,
            "omnistage.replica": replica.address,
            "omnistage.role": step.role,
        }
        with tracing.span(f"step {step.name}", kind="client", **where):
            return await self._call_stage(req, step, replica, inputs, consumer, outputs, stream_in)

    async def _call_stage(
        self,
        req: FlowRequest,
        step: PlanStep,
        replica: Replica,
        inputs: tensor_pb2.StageState,
        consumer: Consumer,
        outputs: list[str],
        stream_in: Stream | None = None,
    ) -> tensor_pb2.StageState:
        request = stage_pb2.StageRequest(
            request_id=req.request_id,
            params=req.params,
            input=inputs,
            role=step.role,
            consumer_host_id=consumer.host_id,
            consumer_gpu_uuid=consumer.gpu_uuid,
            consumer_ipc_namespace=consumer.ipc_namespace,
            progress_every=TOKEN_PROGRESS_EVERY if step.progress == "tokens" else req.options.progress_every,
            preview_every=req.options.preview_every if step.progress == "steps" else 0,
            outputs=outputs,
            streaming=stream_in is not None,
            followers=self.followers(req, step) if step.progress == "steps" else finished_with(inputs.meta),
        )
        if step.resumable:
            # Checkpoints serve failover: without another replica to resume on they only cost.
            if len(self.pool.serving(step.stage, req.params.model, step.role)) > 1:
                request.checkpoint_every = self.checkpoint_every
            if step.name in req.checkpoints:
                request.resume.CopyFrom(req.checkpoints[step.name][1])
                resumes = "request %s: %s resumes on %s from its checkpoint"
                log.info(resumes, req.request_id, step.name, replica.address)
        own_leases = self._export_media(req, step, request, replica)
        timeout = req.timeout(self.stage_timeout_s)
        started_event = cpb.StageStarted(
            stage=replica.stage, replica=replica.address, step=step.name, role=step.role
        )
        await req.emit(cpb.GenerateEvent(stage_started=started_event))
        started = time.perf_counter()
        result: stage_pb2.StageResult | None = None
        replica.in_flight += 1
        feeder: asyncio.Task[None] | None = None
        try:
            async with self.offload.turn(replica) if self.offload else contextlib.nullcontext():
                events = replica.stub.Run(request, timeout=timeout)
                if stream_in is not None:
                    feeder = asyncio.create_task(
                        feed(replica.stub, req.request_id, step.role, stream_in, timeout=timeout)
                    )
                async for event in events:
                    if event.HasField("step"):
                        await self._on_step(req, step, replica, event.step)
                    elif event.HasField("result"):
                        result = event.result
                        req.leases.add(replica.address, result.output)
        except asyncio.CancelledError:
            # The request is over (cancelled): a result on its way now would never be read,
            # and its leases would live until their TTL. The replica ends them by request id.
            release_later(self.transport, replica.address, [], req.request_id)
            raise
        except grpc.RpcError as err:
            raise stage_failure(err, replica, self.pool, req.request_id) from None
        finally:
            if feeder is not None:
                feeder.cancel()
            replica.in_flight -= 1
            self.transport.release(own_leases)
        if result is None:
            raise OmniError(f"{replica.stage} at {replica.address} ended without a result")
        finished = cpb.StageFinished(
            stage=replica.stage,
            wall_ms=(time.perf_counter() - started) * 1e3,
            compute_ms=result.compute_ms,
            step=step.name,
        )
        await req.emit(cpb.GenerateEvent(stage_finished=finished))
        return result.output

    def _export_media(
        self, req: FlowRequest, step: PlanStep, request: stage_pb2.StageRequest, replica: Replica
    ) -> list[str]:
        """Put the request inputs `step` consumes into our arena for `replica`; their leases."""
        names = [name for name in step.consumes if name.startswith(INPUT_PREFIX)]
        if not names:
            return []
        assert replica.info is not None
        consumer = Consumer(replica.info.host_id)
        exported = self.transport.export_state(
            {name: torch.frombuffer(bytearray(req.media[name]), dtype=torch.uint8) for name in names},
            {},
            consumer=consumer,
        )
        request.input.tensors.extend(exported.tensors)
        return self.transport.lease_ids(exported)

    async def _on_step(
        self, req: FlowRequest, step: PlanStep, replica: Replica, progress: stage_pb2.StepProgress
    ) -> None:
        if progress.HasField("partial"):
            await self._on_partial(req, step, replica, progress.partial)
        if progress.HasField("checkpoint"):
            await self._keep_checkpoint(req, step, replica, progress.checkpoint)
        if step.progress == "tokens":
            event = cpb.TokenProgress(step=step.name, tokens=progress.step, total=progress.total)
            await req.emit(cpb.GenerateEvent(tokens=event))
        elif step.progress == "steps" and (
            progress.step % max(req.options.progress_every, 1) == 0 or progress.step == progress.total
        ):
            denoise = cpb.DenoiseStep(
                step=progress.step, total=progress.total, preview_png=progress.preview_png
            )
            await req.emit(cpb.GenerateEvent(step=denoise))

    async def _keep_checkpoint(
        self, req: FlowRequest, step: PlanStep, replica: Replica, checkpoint: tensor_pb2.StageState
    ) -> None:
        """Make `checkpoint` the step's latest, held in this process's store (inline ones are
        here already), so that a request resumes after its replica's host memory is gone too.
        A checkpoint that cannot be read any more (its replica died meanwhile) is skipped:
        the previous one still holds."""
        holder = replica.address
        req.leases.add(holder, checkpoint)
        if self.transport.lease_ids(checkpoint):
            try:
                tensors, meta = await self.transport.import_state(checkpoint)
            except OmniError as err:
                log.warning("request %s: checkpoint not kept: %s", req.request_id, err.message)
                return
            finally:
                req.leases.drop(holder, checkpoint)
            holder, checkpoint = self.transport.address, self.transport.export_state(tensors, meta)
            req.leases.add(holder, checkpoint)
        if step.name in req.checkpoints:
            req.leases.drop(*req.checkpoints[step.name])
        req.checkpoints[step.name] = (holder, checkpoint)

    async def _on_partial(
        self, req: FlowRequest, step: PlanStep, replica: Replica, partial: tensor_pb2.StageState
    ) -> None:
        """A chunk of a streaming step: kept for the steps that stream it in; its text and, from
        the result step, its audio go to the client."""
        stream = req.stream(step.name)
        stream.producer = replica.address
        req.leases.add(replica.address, partial)
        if not stream.fresh(partial):
            req.leases.drop(replica.address, partial)  # a repeat after a restart
            return
        is_audio = "audio" in (ref.name for ref in partial.tensors)
        if not is_audio and self.transport.lease_ids(partial):
            try:
                partial = await self._hold(req, replica.address, partial)
            except OmniError as err:  # its producer died as it arrived: the step moves on
                lost = f"{replica.stage} replica {replica.address} was lost ({err.message})"
                raise ReplicaLost(lost) from None
        stream.push(partial)
        if partial.meta.get("text"):
            req.text.append(partial.meta["text"])
            await req.emit(cpb.GenerateEvent(text=cpb.TextDelta(step=step.name, text=partial.meta["text"])))
        if not is_audio:
            return
        try:  # audio: the client's alone, so its leases end once it is read
            tensors, meta = await self.transport.import_state(partial)
            samples = tensors["audio"].to(torch.float32).view(-1).clone()
        finally:
            req.leases.drop(replica.address, partial)
        await send_audio(req, samples, meta)

    async def _hold(
        self, req: FlowRequest, holder: str, chunk: tensor_pb2.StageState
    ) -> tensor_pb2.StageState:
        """`chunk` (handles into `holder`'s memory) copied into this process's store, so that a
        consumer restarted after `holder` died can read it; `holder`'s leases end here."""
        try:
            tensors, meta = await self.transport.import_state(chunk)
        finally:
            req.leases.drop(holder, chunk)
        kept = self.transport.export_state(tensors, meta)
        req.leases.add(self.transport.address, kept)
        return kept
