"""The gateway's HTTP routes (Starlette): OpenAI's image API translated to the coordinator's
gRPC, the try-it page, health.

Every route is a thin translation: the coordinator validates, routes and enforces API keys
(the caller's key, `Authorization: Bearer KEY` or `x-api-key`, goes with the gRPC call; a
refusal comes back as 401), and its gRPC status becomes the HTTP status (protocol.py).
A streamed request commits to HTTP 200 only once the coordinator has accepted every image
of it, so a refused request still gets its own status; a failure after that is an `error`
event. A client that goes away cancels its requests in every stage.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omni_common.client import AsyncClient
from omni_common.errors import InvalidArgument, OmniError
from omni_common.runtime import tracing
from omni_common.runtime.auth import API_KEY_HEADER
from omni_common.runtime.config import GatewayConfig
from omnistage.v1 import coordinator_pb2 as cpb
from services.gateway.protocol import (
    MAX_BODY_BYTES,
    SSE_DONE,
    error_body,
    image_item,
    image_job,
    model_entry,
    parse_json,
    sse,
)

log = logging.getLogger("omnistage.gateway")

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
Events = AsyncIterator[cpb.GenerateEvent]
T = TypeVar("T")


@dataclass
class GatewayState:
    """What the routes share: the coordinator's client and whether the gateway drains."""

    config: GatewayConfig
    client: AsyncClient | None = None
    draining: bool = False
    in_flight: int = 0


def credentials(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's API key as the coordinator reads it (omni_common.runtime.auth)."""
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get(API_KEY_HEADER, "")
    return ((API_KEY_HEADER, key),) if key else ()


def error_response(err: OmniError) -> JSONResponse:
    status, body, headers = error_body(err)
    return JSONResponse(body, status_code=status, headers=headers)


class _Image:
    """Folds one image's GenerateEvents: its result and per-step wall times."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.timings: dict[str, float] = {}
        self.result: cpb.Result | None = None

    def add(self, event: cpb.GenerateEvent) -> None:
        if event.HasField("stage_finished"):
            finished = event.stage_finished
            self.timings[finished.step or finished.stage] = round(finished.wall_ms, 3)
        elif event.HasField("result"):
            self.result = event.result

    def item(self) -> dict[str, Any]:
        if self.result is None:
            raise OmniError("the coordinator's stream ended without a result", grpc.StatusCode.DATA_LOSS)
        if self.result.kind not in ("", "image"):  # a model that speaks or writes
            raise InvalidArgument(
                f"this model answers with {self.result.kind}, not an image; "
                "/v1/images/generations serves image models"
            )
        return image_item(self.result, self.seed, self.timings)


def build_app(config: GatewayConfig) -> Starlette:
    """The gateway's ASGI application for `config` (the coordinator is reached at start-up)."""
    state = GatewayState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Channels are made on the serving loop; a request's deadline is set per call.
        state.client = AsyncClient(config.coordinator, timeout=config.request_timeout_s, api_key="")
        try:
            yield
        finally:
            await state.client.close()

    async def page(request: Request) -> Response:
        return FileResponse(PAGE, media_type="text/html; charset=utf-8")

    async def health(request: Request) -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def list_models(request: Request) -> Response:
        assert state.client is not None
        try:
            models = await state.client.list_models(credentials(request))
        except OmniError as err:
            return error_response(err)
        return JSONResponse({"object": "list", "data": [model_entry(m) for m in models]})

    async def get_model(request: Request) -> Response:
        assert state.client is not None
        name = request.path_params["model"]
        try:
            models = await state.client.list_models(credentials(request))
        except OmniError as err:
            return error_response(err)
        for model in models:
            if model.name == name:
                return JSONResponse(model_entry(model))
        return error_response(OmniError(f"unknown model {name[:100]!r}", grpc.StatusCode.NOT_FOUND))

    async def generate(request: Request) -> Response:
        assert state.client is not None
        if state.draining:
            return error_response(OmniError("the gateway is shutting down", grpc.StatusCode.UNAVAILABLE))
        # The request's trace: its root here, or a child of the caller's (W3C traceparent).
        span = tracing.start("POST /v1/images/generations", kind="server", carrier=request.headers)
        state.in_flight += 1
        try:
            job = image_job(parse_json(await _body(request)), config.max_images)
            span.set_attribute("omnistage.images", len(job.requests))
            calls = [
                state.client.stream(r, config.request_timeout_s, credentials(request)) for r in job.requests
            ]
            with tracing.current(span):  # the calls carry it to the coordinator
                # The first event (Accepted) says the coordinator took the request: only then
                # is it 200; a refusal before it keeps its own status.
                firsts = await _first_events(calls)
        except OmniError as err:
            state.in_flight -= 1
            return _failed(span, err)
        except BaseException:
            state.in_flight -= 1
            span.end()
            raise
        seeds = [r.params.seed for r in job.requests]
        if job.stream:
            return StreamingResponse(
                _tracked(state, span, _stream(calls, firsts, seeds)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            items = await _unless_gone(request, _collect(calls, firsts, seeds))
        except OmniError as err:
            return _failed(span, err)
        finally:
            state.in_flight -= 1
        if items is None:  # the client went away: its requests were cancelled
            span.set_attribute("http.status_code", 499)
            span.end()
            return Response(status_code=499)
        span.set_attribute("http.status_code", 200)
        span.end()
        return JSONResponse({"created": int(time.time()), "data": items})

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/health", health),
            Route("/v1/models", list_models),
            Route("/v1/models/{model:path}", get_model),
            Route("/v1/images/generations", generate, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.state.gateway = state
    return app


async def _body(request: Request) -> bytes:
    """The request's body, read only up to MAX_BODY_BYTES (more is refused: 400)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise InvalidArgument(f"the request body is over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise InvalidArgument(f"the request body is over {MAX_BODY_BYTES} bytes")
    return bytes(body)


def _failed(span: Any, err: OmniError) -> JSONResponse:
    response = error_response(err)
    span.set_attribute("http.status_code", response.status_code)
    span.end()
    return response


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None (and `work` cancelled) once the client has closed the
    connection: a generation nobody waits for stops in every stage."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _first(call: Events) -> cpb.GenerateEvent:
    async for event in call:
        return event
    raise OmniError("the coordinator's stream ended at once", grpc.StatusCode.DATA_LOSS)


async def _all(work: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of `work`, run at once; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first_events(calls: list[Events]) -> list[cpb.GenerateEvent]:
    """Every call's first event, at once; on any failure every call is closed (cancelled)."""
    try:
        return await _all([_first(call) for call in calls])
    except BaseException:
        await _close(calls)
        raise


async def _close(calls: list[Events]) -> None:
    for call in calls:
        with contextlib.suppress(BaseException):
            await call.aclose()  # type: ignore[attr-defined]


async def _collect(
    calls: list[Events], firsts: list[cpb.GenerateEvent], seeds: list[int]
) -> list[dict[str, Any]]:
    """Every image of a request (non-streamed), in order."""

    async def one(call: Events, first: cpb.GenerateEvent, seed: int) -> dict[str, Any]:
        image = _Image(seed)
        image.add(first)
        async for event in call:
            image.add(event)
        return image.item()

    try:
        return await _all([one(c, f, s) for c, f, s in zip(calls, firsts, seeds, strict=True)])
    finally:
        await _close(calls)


async def _stream(
    calls: list[Events], firsts: list[cpb.GenerateEvent], seeds: list[int]
) -> AsyncIterator[bytes]:
    """The SSE body: each image's step, preview and stage events as they come (`index` says
    which image), its `image_generation.completed` event, then `[DONE]`; a failure is an
    `error` event and ends the stream."""
    queue: asyncio.Queue[tuple[int, cpb.GenerateEvent | OmniError | None]] = asyncio.Queue()

    async def pump(index: int, call: Events) -> None:
        try:
            async for event in call:
                await queue.put((index, event))
        except OmniError as err:
            await queue.put((index, err))
        finally:
            await queue.put((index, None))

    images = [_Image(seed) for seed in seeds]
    for image, first in zip(images, firsts, strict=True):
        image.add(first)
    pumps = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    previews = [0] * len(calls)
    try:
        open_calls = len(calls)
        while open_calls:
            index, event = await queue.get()
            if event is None:
                open_calls -= 1
                continue
            if isinstance(event, OmniError):
                _, body, _ = error_body(event)
                yield sse({"type": "error", "index": index, **body})
                return
            images[index].add(event)
            for payload in _payloads(index, event, images[index], previews):
                yield sse(payload)
        yield SSE_DONE
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await _close(calls)


def _payloads(
    index: int, event: cpb.GenerateEvent, image: _Image, previews: list[int]
) -> list[dict[str, Any]]:
    """The SSE payloads of one coordinator event."""
    kind = event.WhichOneof("event")
    if kind == "step":
        step = event.step
        out: list[dict[str, Any]] = [
            {"type": "image_generation.step", "index": index, "step": step.step, "total": step.total}
        ]
        if step.preview_png:
            out.append(
                {
                    "type": "image_generation.partial_image",
                    "index": index,
                    "partial_image_index": previews[index],
                    "step": step.step,
                    "b64_json": base64.b64encode(step.preview_png).decode(),
                    "output_format": "png",
                }
            )
            previews[index] += 1
        return out
    if kind == "stage_started":
        started = event.stage_started
        return [
            {
                "type": "image_generation.stage_started",
                "index": index,
                "step": started.step,
                "stage": started.stage,
            }
        ]
    if kind == "stage_finished":
        finished = event.stage_finished
        return [
            {
                "type": "image_generation.stage_finished",
                "index": index,
                "step": finished.step or finished.stage,
                "stage": finished.stage,
                "wall_ms": round(finished.wall_ms, 3),
                "compute_ms": round(finished.compute_ms, 3),
            }
        ]
    if kind == "waiting":
        waiting = event.waiting
        return [
            {
                "type": "image_generation.waiting",
                "index": index,
                "stage": waiting.stage,
                "max_wait_ms": waiting.max_wait_ms,
            }
        ]
    if kind == "result":
        item = image.item()
        return [{"type": "image_generation.completed", "index": index, "output_format": "png", **item}]
    return []


async def _tracked(state: GatewayState, span: Any, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`body`, counted in flight (a drain waits for open streams) and traced until it ends."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        state.in_flight -= 1
        span.end()
