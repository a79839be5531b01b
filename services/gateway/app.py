"""The gateway's HTTP routes (Starlette): OpenAI's image API translated to the coordinator's
gRPC, the try-it page, health.

Every route is a thin translation: the coordinator validates, routes and enforces API keys
(the caller's key, `Authorization: Bearer KEY` or `x-api-key`, goes with the gRPC call; a
refusal comes back as 401), and its gRPC status becomes the HTTP status (protocol.py).
A streamed request commits to HTTP 200 only once the coordinator has accepted every image
of it, so a refused request still gets its own status; a failure after that is an `error`
event (streams.py). A client that goes away cancels its requests in every stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
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
from omni_common.runtime.metrics import GatewayMetrics
from services.gateway.protocol import MAX_BODY_BYTES, error_body, image_job, model_entry, parse_json
from services.gateway.streams import collect, first_events, sse_body

log = logging.getLogger("omnistage.gateway")

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
T = TypeVar("T")


@dataclass
class GatewayState:
    """What the routes share: the coordinator's client, whether the gateway drains, its
    metrics."""

    config: GatewayConfig
    client: AsyncClient | None = None
    draining: bool = False
    in_flight: int = 0
    metrics: GatewayMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = GatewayMetrics(lambda: self.in_flight)


class _Served:
    """One generation request's bookkeeping, from its arrival to its response's end: its
    trace span (a child of the caller's `traceparent`, if any), the in-flight count a drain
    waits for, its metrics."""

    def __init__(self, state: GatewayState, route: str, request: Request) -> None:
        self.state = state
        self.route = route
        self.started = time.perf_counter()
        self.span = tracing.start(f"POST {route}", kind="server", carrier=request.headers)
        state.in_flight += 1

    def end(self, response: Response) -> Response:
        """Book the request as answered with `response`, and return it."""
        status = response.status_code
        self.state.in_flight -= 1
        self.state.metrics.answered(self.route, status, time.perf_counter() - self.started)
        self.span.set_attribute("http.status_code", status)
        self.span.end()
        return response

    async def until_done(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A streamed body, booked as answered (200) when it ends."""
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.end(Response(status_code=200))


def credentials(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's API key as the coordinator reads it (omni_common.runtime.auth)."""
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get(API_KEY_HEADER, "")
    return ((API_KEY_HEADER, key),) if key else ()


def error_response(err: OmniError) -> JSONResponse:
    status, body, headers = error_body(err)
    return JSONResponse(body, status_code=status, headers=headers)


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

    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.text()
        return Response(body, media_type=content_type)

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
        served = _Served(state, "/v1/images/generations", request)
        try:
            job = image_job(parse_json(await _body(request)), config.max_images)
            served.span.set_attribute("omnistage.images", len(job.requests))
            calls = [
                state.client.stream(r, config.request_timeout_s, credentials(request)) for r in job.requests
            ]
            with tracing.current(served.span):  # the calls carry it to the coordinator
                # The first event (Accepted) says the coordinator took the request: only then
                # is it 200; a refusal before it keeps its own status.
                firsts = await first_events(calls)
            seeds = [r.params.seed for r in job.requests]
            if job.stream:
                return StreamingResponse(
                    served.until_done(sse_body(calls, firsts, seeds)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            items = await _unless_gone(request, collect(calls, firsts, seeds))
        except OmniError as err:
            return served.end(error_response(err))
        except BaseException:
            served.end(Response(status_code=500))
            raise
        if items is None:  # the client went away: its requests were cancelled
            return served.end(Response(status_code=499))
        return served.end(JSONResponse({"created": int(time.time()), "data": items}))

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/health", health),
            Route("/metrics", metrics),
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
