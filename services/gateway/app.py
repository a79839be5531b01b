"""The gateway's HTTP routes (Starlette): OpenAI's image, speech and chat APIs translated to
the coordinator's gRPC, the try-it page, health.

Every route is a thin translation: the coordinator validates, routes and enforces API keys
(the caller's key, `Authorization: Bearer KEY` or `x-api-key`, goes with the gRPC call; a
refusal comes back as 401), and its gRPC status becomes the HTTP status (protocol.py).
A streamed request commits to HTTP 200 only once the coordinator has accepted every image
of it, so a refused request still gets its own status; a failure after that is an `error`
event (streams.py). A client that goes away cancels its requests in every stage. Speech and
chat (speech_routes.py) commit to 200 at their reply's first content, for the same reason.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from omni_common.client import AsyncClient
from omni_common.errors import OmniError
from omni_common.runtime import tracing
from omni_common.runtime.config import GatewayConfig
from services.gateway.forms import form_document, parse_form
from services.gateway.protocol import (
    IMAGE_FIELDS,
    MAX_UPLOAD_BYTES,
    BadField,
    ImageJob,
    blame,
    image_job,
    model_entry,
    parse_json,
)
from services.gateway.serving import (
    FramingGuard,
    GatewayState,
    Served,
    WatchedStream,
    credentials,
    error_response,
    guarded,
    read_body,
    unless_gone,
)
from services.gateway.speech_routes import SpeechRoutes
from services.gateway.streams import collect, first_events, sse_body

log = logging.getLogger("omnistage.gateway")

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
ImageReader = Callable[[Request], Awaitable[ImageJob]]


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

    async def run_images(request: Request, route: str, read: ImageReader) -> Response:
        """POST /v1/images/generations or /edits: `read` validates the body into a job."""
        assert state.client is not None
        if state.draining:
            return error_response(OmniError("the gateway is shutting down", grpc.StatusCode.UNAVAILABLE))
        served = Served(state, route, request)
        try:
            job = await read(request)
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
                return WatchedStream(
                    served.until_done(sse_body(calls, firsts, seeds)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            items = await unless_gone(request, collect(calls, firsts, seeds))
        except OmniError as err:
            return served.end(error_response(blame(err, IMAGE_FIELDS)))
        except BaseException:
            served.end(Response(status_code=500))
            raise
        if items is None:  # the client went away: its requests were cancelled
            return served.end(Response(status_code=499))
        return served.end(JSONResponse({"created": int(time.time()), "data": items}))

    async def generation_job(request: Request) -> ImageJob:
        return image_job(parse_json(await read_body(request)), config.max_images)

    async def edit_job(request: Request) -> ImageJob:
        body = await read_body(request, MAX_UPLOAD_BYTES, param="image")
        fields, images = parse_form(request.headers.get("content-type", ""), body)
        if not images:
            raise BadField("image", "image is required: the image (or image[] images) to edit")
        return image_job(form_document(fields), config.max_images, tuple(images))

    async def generate(request: Request) -> Response:
        return await run_images(request, "/v1/images/generations", generation_job)

    async def edit(request: Request) -> Response:
        return await run_images(request, "/v1/images/edits", edit_job)

    speech_routes = SpeechRoutes(state, config, error_response)

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", guarded(list_models)),
            Route("/v1/models/{model:path}", guarded(get_model)),
            Route("/v1/images/generations", guarded(generate), methods=["POST"]),
            Route("/v1/images/edits", guarded(edit), methods=["POST"]),
            Route("/v1/audio/speech", guarded(speech_routes.speech), methods=["POST"]),
            Route("/v1/chat/completions", guarded(speech_routes.chat), methods=["POST"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(FramingGuard)],
    )
    app.state.gateway = state
    return app
