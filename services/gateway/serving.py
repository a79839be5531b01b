"""What the gateway's routes share: its state, a request's bookkeeping (span, in-flight count,
metrics), the caller's credentials, bodies read within a limit, OpenAI's error responses (a
500 with a request id for the unexpected), and the cancellation of work whose client left."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_common.client import AsyncClient
from omni_common.errors import InvalidArgument, OmniError
from omni_common.runtime import tracing
from omni_common.runtime.auth import API_KEY_HEADER
from omni_common.runtime.config import GatewayConfig
from omni_common.runtime.metrics import GatewayMetrics
from services.gateway.protocol import MAX_BODY_BYTES, BadField, error_body

log = logging.getLogger("omnistage.gateway")

T = TypeVar("T")
BODY_TIMEOUT_S = 30.0  # a request's whole body, once its headers came


class BodyTimeout(OmniError):
    """The body did not arrive in time: 408 (the client was too slow, not the server)."""

    http_status = 408


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


class Served:
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


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, param: str | None = None) -> bytes:
    """The request's body, read only up to `limit` bytes (more is refused: 400, about `param`)."""
    declared = request.headers.get("content-length", "")
    too_big = f"the request body is over {limit} bytes"
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BadField(param, too_big) if param else InvalidArgument(too_big)
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise BadField(param, too_big) if param else InvalidArgument(too_big)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None
    return bytes(body)


class FramingGuard:
    """ASGI middleware: a request with both Content-Length and Transfer-Encoding is refused and
    its connection closed (RFC 9112 section 6.1): a proxy before the gateway may have framed it the
    other way, and what follows it on the connection could be a smuggled request."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                err = InvalidArgument("a request may not carry both Content-Length and Transfer-Encoding")
                response = error_response(err)
                response.headers["connection"] = "close"  # uvicorn closes after this response
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guarded(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """`route`, answering an unexpected failure with OpenAI's 500 and a request id (logged with
    its traceback here, never sent)."""

    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except Exception:
            request_id = uuid.uuid4().hex[:16]
            log.exception("%s %s failed (request id %s)", request.method, request.url.path, request_id)
            body = {
                "error": {
                    "message": f"the gateway failed to serve this request (request id {request_id})",
                    "type": "server_error",
                    "param": None,
                    "code": "internal",
                }
            }
            return JSONResponse(body, status_code=500, headers={"x-request-id": request_id})

    return answer


async def unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
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


class WatchedStream(StreamingResponse):
    """A streamed body that ends as soon as its client disconnects, even while no byte is due
    (a reply waiting for its next audio chunk): its generator is closed, which closes the
    coordinator calls it reads and so cancels the request in every stage. (Starlette watches
    for the disconnect only under ASGI specs before 2.4; under later ones it notices at the
    next write.)"""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):  # the client went away mid-write
                await self.stream_response(send)

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(self.listen_for_disconnect(receive))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.background is not None:
            await self.background()
