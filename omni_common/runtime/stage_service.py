"""The Stage gRPC servicer shared by all three stages.

It validates the request (parameters, the role asked for, input images), imports the input
tensors (mapping handles, checking leases), runs the role on the stage worker, exports the
output into this process's arena and streams events. Torch work happens only inside the
worker; errors become gRPC statuses here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Protocol, runtime_checkable

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from omni_common.audio_input import input_audios
from omni_common.errors import DeadlineExceeded, InvalidArgument, NotFound, OmniError, Unavailable, abort
from omni_common.imaging import input_images
from omni_common.models.base import GenerationRequest, ModelFamily, StageState
from omni_common.models.model_defaults import ModelDefaults
from omni_common.models.validation import check_request_id, to_request
from omni_common.runtime.calls import Progress, StageCall
from omni_common.runtime.config import StageConfig
from omni_common.runtime.feeds import Chunk, Feeds, Inbox
from omni_common.runtime.memory import Transition
from omni_common.runtime.metrics import StageMetrics
from omni_common.runtime.registration import deregister, keep_registered
from omni_common.runtime.serve import advertised_address, serve
from omni_common.runtime.stage_control import ControlledWorker, StageControlServicer
from omni_common.runtime.step_scheduler import StepTotals
from omni_common.transport import Consumer, TensorTransport, add_tensor_store, gpu_uuid, ipc_namespace
from omni_common.video_input import input_videos
from omnistage.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("omnistage.stage")


class StageWorker(ControlledWorker, Protocol):
    """What the servicers need of services/<stage>/worker.py."""

    stage: str
    model_name: str
    family: ModelFamily
    model_defaults: ModelDefaults  # the model directory's own (omnistage.json)
    device: torch.device
    dtype: torch.dtype
    in_flight: int
    weight_bytes: int
    on_memory_change: Callable[[], Awaitable[None]] | None

    @property
    def roles(self) -> list[str]:
        """The roles served, the default one first."""
        ...

    @property
    def awake(self) -> bool: ...

    @property
    def device_name(self) -> str:
        """StageInfo.device: the device, or the devices of a replica over several."""
        ...

    @property
    def device_memory_bytes(self) -> int: ...

    def load(self) -> int:
        """The stage's own load signal (StageInfo.load)."""
        ...

    def lora_names(self) -> list[str]:
        """LoRA adapters loaded here (StageInfo.loras); empty for models without them."""
        ...

    def step_totals(self) -> Mapping[str, StepTotals]:
        """Steps and their device and idle time, by step-wise role (metrics)."""
        ...

    async def ensure_awake(self) -> None: ...

    async def sleep(self, level: int) -> Transition: ...

    async def wake(self) -> Transition: ...

    def validate(self, request: GenerationRequest) -> None: ...

    def handler(self, role: str) -> object:
        """NOT_FOUND for a role the replica does not serve."""
        ...

    def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        """Progress events, then one StageState holding at least `call.outputs` (all when empty)."""
        ...

    def close(self) -> None:
        """Free what the worker holds (its device worker processes, its shared memory)."""
        ...


@runtime_checkable
class LosesDeviceWorkers(Protocol):
    """A worker spread over device worker processes (group_runner.GroupWorker): it calls `on_lost` with
    the reason once one of them is gone."""

    on_lost: Callable[[str], None] | None


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse NaN/Inf inputs: they would silently turn into a black or noisy image."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InvalidArgument(f"input tensor {name!r} contains NaN or Inf")


def _select(tensors: dict[str, torch.Tensor], wanted: frozenset[str], stage: str) -> dict[str, torch.Tensor]:
    """The tensors the caller asked for (all of them when it named none)."""
    if not wanted:
        return tensors
    missing = wanted - tensors.keys()
    if missing:
        raise InvalidArgument(f"{stage} has no output named {sorted(missing)[0][:50]!r}")
    return {name: tensors[name] for name in wanted}


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, worker: StageWorker, transport: TensorTransport, max_pixels: int) -> None:
        self.worker = worker
        self.transport = transport
        self.max_pixels = max_pixels
        self.draining = False
        # Draining, yet answering prefix exports for a while (StageConfig.drain_linger_s).
        self.lingering = False
        self.down = ""  # why the replica cannot serve any more (a device worker died); "" = it can
        self.feeds = Feeds()
        self.metrics = StageMetrics(worker.stage, worker.load, lambda: worker.in_flight, worker.step_totals)

    def info(self) -> stage_pb2.StageInfo:
        return stage_pb2.StageInfo(
            stage=self.worker.stage,
            model=self.worker.model_name,
            family=self.worker.family.name,
            host_id=self.transport.host_id,
            device=self.worker.device_name,
            dtype=str(self.worker.dtype).removeprefix("torch."),
            address=self.transport.address,
            queue_depth=self.worker.in_flight,
            load=self.worker.load(),
            gpu_uuid=gpu_uuid(self.worker.device),
            ipc_namespace=ipc_namespace(),
            asleep=not self.worker.awake,
            weight_bytes=self.worker.weight_bytes,
            device_memory_bytes=self.worker.device_memory_bytes,
            roles=self.worker.roles,
            loras=self.worker.lora_names(),
            model_defaults=self.worker.model_defaults.fields,
            option_defaults=self.worker.model_defaults.options,
            draining=self.draining,
        )

    async def Info(
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfo:
        if self.draining and not self.lingering:  # routers treat the replica as gone
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker.stage} is shutting down")
        return self.info()

    def _step_event(self, progress: Progress, consumer: Consumer) -> stage_pb2.StepProgress:
        event = stage_pb2.StepProgress(
            step=progress.step,
            total=progress.total,
            step_ms=progress.step_ms,
            preview_png=progress.preview_png,
        )
        if progress.partial is not None:
            # The caller owns these leases (it releases them once the chunk's readers finished).
            event.partial.CopyFrom(
                self.transport.export_state(
                    progress.partial.tensors, progress.partial.meta, consumer=consumer
                )
            )
        if progress.checkpoint is not None:
            checkpoint = progress.checkpoint
            # The coordinator owns these leases from here (it releases superseded ones). No
            # GPU named: a checkpoint must outlive this process, so it goes to host memory.
            event.checkpoint.CopyFrom(
                self.transport.export_state(
                    checkpoint.tensors, checkpoint.meta, consumer=Consumer(consumer.host_id)
                )
            )
        return event

    def _check(self, request: stage_pb2.StageRequest) -> GenerationRequest:
        """The request's parameters, checked (not yet its images: see _with_images)."""
        if self.down:
            raise Unavailable(f"{self.worker.stage} {self.down}; retry on another replica")
        if self.draining and not (self.lingering and request.export_prefix):
            raise Unavailable(f"{self.worker.stage} is shutting down; retry on another replica")
        check_request_id(request.request_id)
        if request.params.model != self.worker.model_name:
            raise NotFound(
                f"model {request.params.model[:100]!r} is not served here; "
                f"this {self.worker.stage} serves {self.worker.model_name!r}"
            )
        self.worker.handler(request.role)
        return to_request(request.params, max_pixels=self.max_pixels)

    def _with_images(self, gen: GenerationRequest, tensors: dict[str, torch.Tensor]) -> GenerationRequest:
        """`gen` with the input images, audio clips and videos this call carries, checked like the
        coordinator checks them (a stage may be called directly), then the family's validation."""
        gen = replace(
            gen,
            images=input_images(tensors, max_pixels=self.max_pixels),
            audios=input_audios(tensors),
            videos=input_videos(tensors, max_pixels=self.max_pixels),
        )
        self.worker.validate(gen)
        return gen

    async def Run(
        self, request: stage_pb2.StageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StageEvent]:
        rid = request.request_id[:128]
        self.worker.in_flight += 1
        # How the metrics count this call; it stays CANCELLED when the caller goes away (the
        # generator is then closed at a `yield`, which no except clause here sees).
        code = grpc.StatusCode.CANCELLED
        inbox = None
        try:
            if request.streaming:  # first, so that Feed calls find it however early they come
                check_request_id(request.request_id)
                inbox = self.feeds.open(rid, request.role)
            call = await self._call(request, context, inbox)
            consumer = Consumer(
                request.consumer_host_id, request.consumer_ipc_namespace, request.consumer_gpu_uuid
            )
            # Closed here, at once, when the caller goes away: its unsent result is then freed.
            async with contextlib.aclosing(self._events(call, consumer)) as events:
                async for event in events:
                    yield event
            code = grpc.StatusCode.OK
        except OmniError as err:
            code = err.code
            log.info("request %s: %s %s", rid, err.code.name, err.message)
            await abort(context, err)
        except asyncio.CancelledError:
            log.info("request %s: cancelled by the caller", rid)
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("request %s: internal error", rid)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in {self.worker.stage} (request {rid}); see the service log",
            )
        finally:
            if code == grpc.StatusCode.CANCELLED:
                # A result sent a moment before the caller went away may never have been read;
                # the caller, gone, uses none of it (and releases what it did read).
                self.transport.release_request(rid)
            if inbox is not None:
                self.feeds.close(rid, request.role)
            self.worker.in_flight -= 1
            self.metrics.requests.finished(code)

    async def _call(
        self, request: stage_pb2.StageRequest, context: grpc.aio.ServicerContext, inbox: Inbox | None
    ) -> StageCall:
        """The request checked, the worker awake and the inputs imported: the call to run."""
        rid = request.request_id[:128]
        gen = self._check(request)
        await self.worker.ensure_awake()
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"request {rid}: the deadline passed before {self.worker.stage}")
        tensors, meta = await self.transport.import_state(request.input)
        check_finite(tensors)
        gen = self._with_images(gen, tensors)
        resume = None
        if request.HasField("resume"):
            resume = StageState(*await self.transport.import_state(request.resume))
            check_finite(resume.tensors)
        return StageCall(
            request_id=rid,
            request=gen,
            inputs=StageState(tensors, meta),
            role=request.role,
            outputs=frozenset(request.outputs),
            progress_every=request.progress_every,
            preview_every=request.preview_every,
            deadline=None if remaining is None else time.monotonic() + remaining,
            checkpoint_every=request.checkpoint_every,
            resume=resume,
            inbox=inbox,
            followers=request.followers,
            export_prefix=request.export_prefix,
        )

    async def _events(
        self, call: StageCall, consumer: Consumer
    ) -> AsyncGenerator[stage_pb2.StageEvent, None]:
        """The worker's progress and results as events, each result exported for `consumer`."""
        started = time.perf_counter()
        async for item in self.worker.run(call):
            if isinstance(item, Progress):
                yield stage_pb2.StageEvent(step=self._step_event(item, consumer))
                continue
            compute_ms = (time.perf_counter() - started) * 1e3
            output = self.transport.export_state(
                _select(item.tensors, call.outputs, self.worker.stage), item.meta, consumer=consumer
            )
            try:
                # Inputs mapped from the GPU memory of the previous stage are released
                # when the coordinator hears this result: the reads must have run.
                await self.transport.finish_imports(
                    [
                        *call.inputs.tensors.values(),
                        *(call.resume.tensors.values() if call.resume is not None else []),
                        *(call.inbox.imported if call.inbox is not None else []),
                    ]
                )
                yield stage_pb2.StageEvent(result=stage_pb2.StageResult(output=output, compute_ms=compute_ms))
            except BaseException:
                # Nobody will ever hear of these leases: free them now, not at TTL.
                self.transport.release(self.transport.lease_ids(output))
                raise
            self.transport.sent(call.request_id, self.transport.lease_ids(output))

    async def Feed(
        self, request: stage_pb2.FeedRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.FeedReply:
        try:
            check_request_id(request.request_id)
            self.worker.handler(request.role)  # NOT_FOUND at once for a role not served here
            inbox = await self.feeds.find(request.request_id, request.role)
            tensors, meta = await self.transport.import_state(request.chunk)
            check_finite(tensors)
            inbox.imported.extend(tensors.values())
            inbox.put(request.index, Chunk(StageState(tensors, meta), request.end))
            self.metrics.fed(request.role)
        except OmniError as err:
            log.info("feed of request %s: %s %s", request.request_id[:128], err.code.name, err.message)
            await abort(context, err)
        return stage_pb2.FeedReply()


async def serve_stage(
    config: StageConfig,
    make_worker: Callable[[StageConfig], StageWorker],
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    transport: TensorTransport | None = None,
) -> None:
    """Load the worker, then serve Stage + TensorStore + Health until stopped."""
    transport = transport or TensorTransport(
        shm_dir=config.shm_dir, lease_ttl_s=config.lease_ttl_s, inline_threshold=config.inline_bytes
    )
    worker = make_worker(config)
    servicer = StageServicer(worker, transport, config.max_pixels)
    health_servicer = health.aio.HealthServicer()
    control = StageControlServicer(worker, health_servicer)
    background: list[asyncio.Task[None]] = []

    async def setup(server: grpc.aio.Server, address: str) -> None:
        transport.address = advertised_address(address, config.advertise_host)
        stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
        stage_pb2_grpc.add_StageControlServicer_to_server(control, server)
        await control.publish()
        add_tensor_store(server, transport)
        if config.coordinator:
            background.append(asyncio.create_task(keep_registered(config.coordinator, servicer.info)))

    def drain() -> None:
        servicer.draining = True
        if config.drain_linger_s > 0 and not servicer.down and keeps_prefixes(worker):
            servicer.lingering = True
            background.append(asyncio.create_task(linger(config.drain_linger_s)))
        else:
            leave()

    async def linger(seconds: float) -> None:
        """Heartbeats go on, saying the replica drains: the coordinator sends it no new work but
        may still ask it for a conversation's prefix, until `seconds` have passed."""
        kept = "%s drains; it answers prefix exports for %.0f s (--drain-linger-s)"
        log.info(kept, config.stage, seconds)
        await asyncio.sleep(seconds)
        servicer.lingering = False
        leave()

    def leave() -> None:
        """Stop heartbeating and deregister: the coordinator forgets this replica."""
        for task in background:
            if task is not asyncio.current_task():
                task.cancel()
        if config.coordinator:
            background.append(asyncio.create_task(deregister(config.coordinator, servicer.info())))

    # This service's own stop: the caller's `stop` ends it, and so does a lost device worker.
    stopping = asyncio.Event()
    if stop is not None:
        outer = stop
        background.append(asyncio.create_task(_relay(outer, stopping)))

    _stop_when_lost(worker, servicer, health_servicer, stopping, background)

    def cleanup() -> None:
        for task in background:
            task.cancel()
        worker.close()
        transport.close()

    def idle() -> bool:
        return worker.in_flight == 0 and transport.live_leases() == 0 and not servicer.lingering

    await serve(
        config.stage,
        config.bind_address,
        setup,
        on_drain=drain,
        is_idle=idle,
        on_stop=cleanup,
        ready=ready,
        stop=stopping,
        health_servicer=health_servicer,
        metrics=servicer.metrics.registry,
        metrics_port=config.metrics_port,
    )
    if servicer.down:
        raise SystemExit(f"{config.stage}: {servicer.down}")


def keeps_prefixes(worker: StageWorker) -> bool:
    """Whether a role of `worker` keeps prompt-prefix KV now (a conversation's earlier turns)."""
    return any(totals.prefix_bytes > 0 for totals in worker.step_totals().values())


def _stop_when_lost(
    worker: StageWorker,
    servicer: StageServicer,
    health_servicer: health.aio.HealthServicer,
    stopping: asyncio.Event,
    background: list[asyncio.Task[None]],
) -> None:
    """Where the worker spreads over device worker processes: when one dies, the replica
    serves nothing more. Its calls in flight have failed with UNAVAILABLE (the coordinator
    resumes them elsewhere); health turns NOT_SERVING at once, then the usual drain
    deregisters it and waits until the coordinator has fetched and released what it holds
    here (checkpoints), and the process exits with an error, so its supervisor starts it
    again."""

    async def lost(reason: str) -> None:
        log.error("%s: %s; the replica stops serving", worker.stage, reason)
        servicer.down = f"lost a device worker ({reason})"
        await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        stopping.set()

    if isinstance(worker, LosesDeviceWorkers):
        loop = asyncio.get_running_loop()

        def on_lost(reason: str) -> None:  # from the group's watcher thread
            loop.call_soon_threadsafe(lambda: background.append(loop.create_task(lost(reason))))

        worker.on_lost = on_lost


async def _relay(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()
