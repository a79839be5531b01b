"""The gateway's HTTP routes (Starlette): OpenAI's image, speech and chat APIs translated to
the coordinator's gRPC, the try-it page, health.

Every route is a thin translation: the coordinator validates, routes and enforces API keys
(the caller's key, `Authorization: Bearer KEY` or `x-api-key`, goes with the gRPC call; a
refusal comes back as 401), and its gRPC status becomes the HTTP status (protocol.py).
Images (image_routes.py) commit to HTTP 200 only once the coordinator has accepted every
image of a request, so a refused request still gets its own status; speech and chat
(speech_routes.py) commit to 200 at their reply's first content, for the same reason. A
client that goes away cancels its requests in every stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from omni_common.client import AsyncClient
from omni_common.errors import OmniError
from omni_common.runtime.config import GatewayConfig
from services.gateway.image_routes import ImageRoutes
from services.gateway.protocol import model_entry
from services.gateway.serving import (
    FramingGuard,
    GatewayState,
    credentials,
    error_response,
    guarded,
)
from services.gateway.speech_routes import SpeechRoutes

PAGE = Path(__file__).resolve().parent / "static" / "index.html"


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

    image_routes = ImageRoutes(state, config)
    speech_routes = SpeechRoutes(state, config, error_response)

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", guarded(list_models)),
            Route("/v1/models/{model:path}", guarded(get_model)),
            Route("/v1/images/generations", guarded(image_routes.generate), methods=["POST"]),
            Route("/v1/images/edits", guarded(image_routes.edit), methods=["POST"]),
            Route("/v1/audio/speech", guarded(speech_routes.speech), methods=["POST"]),
            Route("/v1/chat/completions", guarded(speech_routes.chat), methods=["POST"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(FramingGuard)],
    )
    app.state.gateway = state
    return app
