"""The routes of models that write and speak: `POST /v1/audio/speech` and
`POST /v1/chat/completions` (speech.py says what each accepts).

Each request is one coordinator call. The route reads it up to the reply's first content
(speech: the first audio; chat: the first text or audio) before it answers, so a refusal
(an unknown voice, an image model) keeps its own HTTP status; then the reply streams as it
comes, with the first audio's time in the `x-first-audio-ms` header (and, for SSE, the last
event). A client that goes away closes the call, which cancels the request in every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omni_common.errors import OmniError
from omni_common.net import tracing
from omni_common.runtime.config import GatewayConfig
from omnistage.v1 import coordinator_pb2 as cpb
from services.gateway.protocol import parse_json
from services.gateway.serving import GatewayState, Served, WatchedStream, credentials, read_body, unless_gone
from services.gateway.speech import CHAT_FIELDS, SPEECH_FIELDS, chat_job, refused, speech_job
from services.gateway.speech_streams import Primed, chat_sse, chat_whole, prime, speech_body, speech_sse

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "flac": "audio/flac"}


class SpeechRoutes:
    """The speech and chat handlers over the gateway's shared state."""

    def __init__(
        self, state: GatewayState, config: GatewayConfig, error_response: Callable[[OmniError], Response]
    ) -> None:
        self.state = state
        self.config = config
        self.error_response = error_response

    async def _start(
        self,
        request: Request,
        served: Served,
        call: cpb.GenerateRequest,
        until: tuple[str, ...],
        fields: tuple[tuple[str, str], ...],
    ) -> Primed | None:
        """The call for `call`, read up to its first content (None: the client left meanwhile)."""
        assert self.state.client is not None
        events = self.state.client.stream(call, self.config.request_timeout_s, credentials(request))
        with tracing.current(served.span):
            return await unless_gone(request, prime(events, served.started, until, fields))

    def _headers(self, primed: Primed) -> dict[str, str]:
        headers = dict(STREAM_HEADERS)
        if primed.first_audio_ms is not None:
            headers["x-first-audio-ms"] = f"{primed.first_audio_ms:.3f}"
        return headers

    async def speech(self, request: Request) -> Response:
        """POST /v1/audio/speech: the spoken reply, streamed as WAV, PCM or SSE."""
        if self.state.draining:
            return self.error_response(OmniError("the gateway is shutting down", grpc.StatusCode.UNAVAILABLE))
        served = Served(self.state, "/v1/audio/speech", request)
        try:
            job = speech_job(parse_json(await read_body(request)))
            primed = await self._start(request, served, job.request, ("audio",), SPEECH_FIELDS)
        except OmniError as err:
            return served.end(self.error_response(refused(err, SPEECH_FIELDS)))
        except BaseException:
            served.end(Response(status_code=500))
            raise
        if primed is None:
            return served.end(Response(status_code=499))
        if job.sse:
            body = speech_sse(primed, job.response_format)
            return WatchedStream(
                served.until_done(body), media_type="text/event-stream", headers=self._headers(primed)
            )
        return WatchedStream(
            served.until_done(speech_body(primed, job.response_format)),
            media_type=MEDIA_TYPES[job.response_format],
            headers=self._headers(primed),
        )

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions: the reply, streamed as chunks or whole."""
        if self.state.draining:
            return self.error_response(OmniError("the gateway is shutting down", grpc.StatusCode.UNAVAILABLE))
        served = Served(self.state, "/v1/chat/completions", request)
        reply: dict[str, Any] | None
        try:
            job = chat_job(parse_json(await read_body(request)))
            primed = await self._start(request, served, job.request, ("text", "audio"), CHAT_FIELDS)
            if primed is None:
                return served.end(Response(status_code=499))
            if job.stream:
                return WatchedStream(
                    served.until_done(chat_sse(primed, job)),
                    media_type="text/event-stream",
                    headers=self._headers(primed),
                )
            reply = await unless_gone(request, chat_whole(primed, job))
        except OmniError as err:
            return served.end(self.error_response(refused(err, CHAT_FIELDS)))
        except BaseException:
            served.end(Response(status_code=500))
            raise
        if reply is None:
            return served.end(Response(status_code=499))
        headers = {}
        if reply.get("first_audio_ms") is not None:
            headers["x-first-audio-ms"] = f"{reply['first_audio_ms']:.3f}"
        return served.end(JSONResponse(reply, headers=headers))
