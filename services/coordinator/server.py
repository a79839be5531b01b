"""Coordinator server: where a client's request enters and where its image leaves.

Generate validates the request (omnistage's ranges, then the model family's own rules and
input images), asks the family for the request's plan, runs it as a RequestFlow in its own
task and streams the task's events; Cancel (or the client going away) cancels that task,
which releases every lease of the request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import grpc

from omni_common.audio_input import canonical_audio, inspect_audio
from omni_common.errors import (
    AlreadyExists,
    Cancelled,
    InvalidArgument,
    NotFound,
    OmniError,
    ResourceExhausted,
    abort,
)
from omni_common.imaging import inspect_image
from omni_common.input_media import INPUT_PREFIX, input_audio_name, input_image_name, input_video_name
from omni_common.models.base import Plan
from omni_common.models.registry import find_family
from omni_common.models.validation import (
    check_media_parts,
    check_options,
    check_request_id,
    check_takes_loras,
    defaults_for,
    option_defaults_for,
    to_request,
    with_defaults,
)
from omni_common.net.auth import Caller, api_keys, caller, cluster_tokens
from omni_common.runtime.config import CoordinatorConfig
from omni_common.runtime.metrics import CoordinatorMetrics
from omni_common.runtime.serve import advertised_address, run, serve
from omni_common.transport import TensorTransport, add_tensor_store
from omni_common.video_input import canonical_video, inspect_video
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import coordinator_pb2_grpc, stage_pb2
from services.coordinator.affinity import PrefixRoutes
from services.coordinator.flow import RequestFlow
from services.coordinator.offload import SwapPolicy
from services.coordinator.output_cache import StepOutputCache
from services.coordinator.prefix_move import PrefixMoves
from services.coordinator.registry import ModelView, RegistryServicer, ReplicaPool

log = logging.getLogger("omnistage.coordinator")

_DONE = None
MAX_MEDIA_BYTES = 48 << 20  # all input media of one request (it must fit a 64 MiB message)


@dataclass(frozen=True)
class Accepted:
    """A validated request: its id, filled-in parameters, plan and input media by tensor name."""

    request_id: str
    params: stage_pb2.GenerationParams
    plan: Plan
    media: dict[str, bytes]


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, pool: ReplicaPool, transport: TensorTransport, config: CoordinatorConfig) -> None:
        self.pool = pool
        offload = SwapPolicy(pool, config.device_memory_budget) if config.offload == "swap" else None
        self.metrics = CoordinatorMetrics(lambda: len(self.in_flight), pool.healthy_counts)
        cache = StepOutputCache(
            transport, config.step_cache_bytes, config.step_cache_ttl_s, registry=self.metrics.registry
        )
        self.flow = RequestFlow(
            pool,
            transport,
            config.stage_timeout_s,
            offload=offload,
            cache=cache,
            replica_wait_s=config.replica_wait_s,
            routes=PrefixRoutes(config.prefix_routes, registry=self.metrics.registry),
            moves=PrefixMoves(
                pool,
                transport,
                config.prefix_prefill_tokens_per_s,
                config.stage_timeout_s,
                registry=self.metrics.registry,
            ),
        )
        self.max_pixels = config.max_pixels
        self.max_in_flight = config.max_in_flight
        # By (owner, request id): a request belongs to the API key that started it. Ids are
        # the caller's to choose, so two keys may pick the same one: each sees its own only.
        self.in_flight: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.flow_ids: set[str] = set()  # the ids the flow runs under, unique cluster-wide
        self.keys, self.tokens = api_keys(), cluster_tokens()

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        return caller(metadata, self.keys, self.tokens)

    def _flow_id(self, request_id: str) -> str:
        """The id the request runs under in the cluster: its own, unless another key's
        request runs under it now (stages key their work by id)."""
        if request_id not in self.flow_ids:
            return request_id
        return f"{request_id[:110]}.{secrets.token_hex(6)}"

    def _hidden(self, event: cpb.GenerateEvent) -> cpb.GenerateEvent:
        """The event as a caller who is not an operator may see it: no replica addresses."""
        if event.HasField("stage_started"):
            event.stage_started.replica = ""
        if event.HasField("error"):
            event.error.message = self._redacted(event.error.message)
        return event

    def _redacted(self, text: str) -> str:
        for address in self.pool.addresses_seen:
            text = text.replace(address, "a replica")
        return text

    def _accept(self, request: cpb.GenerateRequest, owner: str = "") -> Accepted:
        if len(self.in_flight) >= self.max_in_flight:
            raise ResourceExhausted(
                f"the coordinator has {len(self.in_flight)} requests in flight, its limit; "
                "retry in a few seconds",
                retry_after_ms=2000,
            )
        request_id = request.request_id or secrets.token_hex(8)
        check_request_id(request_id)
        if (owner, request_id) in self.in_flight:  # only the owner's own ids: no oracle
            raise AlreadyExists(f"request {request_id} is already in flight; use another id")
        model = self.pool.resolve_model(request.params.model)
        family = self.pool.family_of(model)
        view = self.pool.models()[model]
        # Only the model's own option defaults go into the request: the family's are the
        # runners' own fallbacks, and requests that name none stay as they were.
        params = with_defaults(
            request.params, defaults_for(family.card, view.model_defaults), view.option_defaults
        )
        params.model = model
        media = self._media(request)
        image_files = [data for name, data in media.items() if name.startswith(INPUT_PREFIX + "image.")]
        images = tuple(
            inspect_image(data, index=i, max_pixels=self.max_pixels) for i, data in enumerate(image_files)
        )
        audio_files = [data for name, data in media.items() if name.startswith(INPUT_PREFIX + "audio.")]
        audios = tuple(inspect_audio(data, index=i) for i, data in enumerate(audio_files))
        if audios and "audio" not in family.card.inputs:
            raise InvalidArgument(f"model {model!r} takes no audio input; got {len(audios)} clips")
        video_files = [data for name, data in media.items() if name.startswith(INPUT_PREFIX + "video.")]
        videos = tuple(
            inspect_video(data, index=i, max_pixels=self.max_pixels) for i, data in enumerate(video_files)
        )
        if videos and "video" not in family.card.inputs:
            raise InvalidArgument(f"model {model!r} takes no video input; got {len(videos)} videos")
        if len(images) > family.card.max_images:
            allowed = f"at most {family.card.max_images}" if family.card.max_images else "no"
            raise InvalidArgument(f"model {model!r} takes {allowed} input images; got {len(images)}")
        gen = replace(
            to_request(params, max_pixels=self.max_pixels, images=images), audios=audios, videos=videos
        )
        check_options(dict(gen.options), family.card.options, family.name)
        check_media_parts(gen)
        check_takes_loras(gen, family.card, family.name)
        family.validate(gen)
        return Accepted(request_id, params, family.plan(gen), media)

    def _media(self, request: cpb.GenerateRequest) -> dict[str, bytes]:
        """The request's input images, audio clips (raw PCM wrapped as WAV) and videos
        (re-serialized; `_accept` checks them) by the tensor name plan steps consume them under."""
        media: dict[str, bytes] = {}
        images = audios = videos = 0
        for i, item in enumerate(request.inputs):
            kind = item.WhichOneof("media")
            if kind == "image":
                media[input_image_name(images)] = item.image
                images += 1
            elif kind == "audio":
                media[input_audio_name(audios)] = canonical_audio(item.audio, index=audios)
                audios += 1
            elif kind == "video":
                media[input_video_name(videos)] = canonical_video(item.video)
                videos += 1
            else:
                raise InvalidArgument(f"input {i} carries no image, audio or video")
        total = sum(len(data) for data in media.values())
        if total > MAX_MEDIA_BYTES:
            raise InvalidArgument(f"input media are {total} bytes in all; the limit is {MAX_MEDIA_BYTES}")
        return media

    async def Generate(
        self, request: cpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cpb.GenerateEvent]:
        who = self._caller(context)
        try:
            accepted = self._accept(request, who.owner)
        except OmniError as err:
            self.metrics.requests.finished(err.code)
            await abort(context, err)
            return
        request_id, params = accepted.request_id, accepted.params
        key, flow_id = (who.owner, request_id), self._flow_id(request_id)
        events: asyncio.Queue[cpb.GenerateEvent | None] = asyncio.Queue()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        task = asyncio.create_task(
            self.flow.run(flow_id, params, request, accepted.plan, deadline, events.put, accepted.media)
        )
        # A done callback, not a `finally` in the task: a task cancelled before it first runs
        # (a Cancel racing the accept) never executes its body, and the stream would hang.
        task.add_done_callback(lambda _: events.put_nowait(_DONE))
        self.in_flight[key] = task
        self.flow_ids.add(flow_id)
        log.info(
            "request %s accepted: %s, %dx%d, %d steps, plan %s",
            flow_id,
            params.model,
            params.width,
            params.height,
            params.num_inference_steps,
            " -> ".join(step.name for step in accepted.plan.steps),
        )
        code = grpc.StatusCode.CANCELLED  # unless the flow ends: the client went away
        try:
            yield cpb.GenerateEvent(accepted=cpb.Accepted(request_id=request_id))
            while (event := await events.get()) is not _DONE:
                yield event if who.operator else self._hidden(event)
            error = await _outcome(task, flow_id)
            code = grpc.StatusCode.OK if error is None else error.code
        finally:
            if not task.done():  # the client went away: stop the work, free its leases
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.in_flight.pop(key, None)
            self.flow_ids.discard(flow_id)
            self.metrics.requests.finished(code)
        if error is not None:
            log.info("request %s failed: %s %s", flow_id, error.code.name, error.message)
            if not who.operator:
                error.message = self._redacted(error.message)
            yield cpb.GenerateEvent(error=cpb.Error(code=error.code.name, message=error.message))
            await abort(context, error)

    async def Cancel(
        self, request: cpb.CancelRequest, context: grpc.aio.ServicerContext
    ) -> cpb.CancelResponse:
        task = self.in_flight.get((self._caller(context).owner, request.request_id))
        if task is None or task.done():
            # Another key's request reads exactly as one that does not exist.
            await abort(context, NotFound(f"no request {request.request_id[:128]!r} of yours is in flight"))
        assert task is not None
        task.cancel()
        log.info("request %s: cancel requested", request.request_id)
        return cpb.CancelResponse(cancelled=True)

    async def ListModels(
        self, request: cpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ListModelsResponse:
        return cpb.ListModelsResponse(
            models=[model_info(name, view) for name, view in sorted(self.pool.models().items())]
        )


def model_info(name: str, view: ModelView) -> cpb.ModelInfo:
    """What clients learn of a served model: its replicas, and its card (its family's, with the
    model directory's own defaults over the family's)."""
    info = cpb.ModelInfo(
        name=name, family=view.family, replicas=view.stages, roles=view.roles, ready=view.ready()
    )
    family = find_family(view.family)
    if family is None:
        return info
    card = family.card
    info.inputs.extend(card.inputs)
    info.max_images = card.max_images
    info.outputs.extend(card.outputs)
    info.defaults.update(defaults_for(card, view.model_defaults))
    info.size_multiple = card.size_multiple
    info.takes_loras = card.loras
    info.loras.update(view.loras)
    options = option_defaults_for(card, view.option_defaults)
    info.options.extend(
        cpb.ModelOption(
            name=spec.name,
            type=spec.type,
            default_value=options[spec.name],
            minimum=spec.minimum,
            maximum=spec.maximum,
            description=spec.description,
        )
        for spec in card.options
    )
    return info


async def _outcome(task: asyncio.Task[None], request_id: str) -> OmniError | None:
    """The request's error, if it failed; internal faults are logged, not leaked."""
    try:
        await task
    except asyncio.CancelledError:
        return Cancelled(f"request {request_id} was cancelled")
    except OmniError as err:
        return err
    except Exception:
        log.exception("request %s: internal error", request_id)
        return OmniError(f"internal error in the coordinator (request {request_id}); see its log")
    return None


async def serve_coordinator(
    config: CoordinatorConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    transport: TensorTransport | None = None,
) -> None:
    pool = ReplicaPool.from_addresses(config.replicas)
    transport = transport or TensorTransport(shm_dir=config.shm_dir)
    servicer = CoordinatorServicer(pool, transport, config)
    refresher: list[asyncio.Task[None]] = []

    async def setup(server: grpc.aio.Server, address: str) -> None:
        transport.address = advertised_address(address, config.advertise_host)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        coordinator_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(pool), server)
        # Request input media travel to the stages from our arena, fetched by remote ones.
        add_tensor_store(server, transport)
        await pool.refresh()
        refresher.append(asyncio.create_task(pool.keep_fresh()))

    def cleanup() -> None:
        for task in refresher:
            task.cancel()
        servicer.flow.cache.clear()
        transport.close()

    await serve(
        "coordinator",
        config.bind_address,
        setup,
        is_idle=lambda: not servicer.in_flight,
        on_stop=cleanup,
        ready=ready,
        stop=stop,
        metrics=servicer.metrics.registry,
        metrics_port=config.metrics_port,
    )


def main(config: CoordinatorConfig) -> None:
    run(serve_coordinator(config))
