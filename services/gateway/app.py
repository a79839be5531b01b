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
from services.gateway.protocol import MAX_BODY_BYTES, error_body, image_job, model_entry, parse_json
from services.gateway.streams import collect, first_events, sse_body

log = logging.getLogger("omnistage.gateway")

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
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
                firsts = await first_events(calls)
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
                _tracked(state, span, sse_body(calls, firsts, seeds)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            items = await _unless_gone(request, collect(calls, firsts, seeds))
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


async def _tracked(state: GatewayState, span: Any, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`body`, counted in flight (a drain waits for open streams) and traced until it ends."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        state.in_flight -= 1
        span.end()
