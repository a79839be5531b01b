"""The image routes: `POST /v1/images/generations` (a JSON body) and `POST /v1/images/edits`
(a multipart form with the images), each one coordinator call per image asked for (`n`).

A request commits to HTTP 200 only once the coordinator has accepted every image of it, so a
refused request still gets its own status; a failure after that is an `error` event
(streams.py). A client that goes away cancels its requests in every stage.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni_common.errors import OmniError
from omni_common.net import tracing
from omni_common.runtime.config import GatewayConfig
from services.gateway.forms import form_document, parse_form
from services.gateway.protocol import (
    IMAGE_FIELDS,
    MAX_UPLOAD_BYTES,
    BadField,
    ImageJob,
    blame,
    image_job,
    parse_json,
)
from services.gateway.serving import (
    GatewayState,
    Served,
    WatchedStream,
    credentials,
    error_response,
    read_body,
    unless_gone,
)
from services.gateway.streams import collect, first_events, sse_body

ImageReader = Callable[[Request], Awaitable[ImageJob]]


class ImageRoutes:
    """The image handlers over the gateway's shared state."""

    def __init__(self, state: GatewayState, config: GatewayConfig) -> None:
        self.state = state
        self.config = config

    async def _run(self, request: Request, route: str, read: ImageReader) -> Response:
        """POST /v1/images/generations or /edits: `read` validates the body into a job."""
        assert self.state.client is not None
        if self.state.draining:
            return error_response(OmniError("the gateway is shutting down", grpc.StatusCode.UNAVAILABLE))
        served = Served(self.state, route, request)
        try:
            job = await read(request)
            served.span.set_attribute("omnistage.images", len(job.requests))
            calls = [
                self.state.client.stream(r, self.config.request_timeout_s, credentials(request))
                for r in job.requests
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

    async def _generation_job(self, request: Request) -> ImageJob:
        return image_job(parse_json(await read_body(request)), self.config.max_images)

    async def _edit_job(self, request: Request) -> ImageJob:
        body = await read_body(request, MAX_UPLOAD_BYTES, param="image")
        fields, images = parse_form(request.headers.get("content-type", ""), body)
        if not images:
            raise BadField("image", "image is required: the image (or image[] images) to edit")
        return image_job(form_document(fields), self.config.max_images, tuple(images))

    async def generate(self, request: Request) -> Response:
        return await self._run(request, "/v1/images/generations", self._generation_job)

    async def edit(self, request: Request) -> Response:
        return await self._run(request, "/v1/images/edits", self._edit_job)
