"""One spoken (or written) reply's coordinator stream as HTTP bodies: the WAV or raw PCM body
of /v1/audio/speech, its SSE events, the chat completion chunks of /v1/chat/completions, or
the whole reply folded.

A route first reads the stream up to its first content (`prime`): an audio route up to the
first audio, a chat route up to the first text or audio. A refusal the stages make once the
request is running (an unknown voice, found when the thinker starts) thus still gets its own
HTTP status, and the first audio's time can go in a header. A failure after that ends the
body: an `error` event in SSE, a cut-off body for raw audio (its status is sent).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from omni_common.errors import OmniError
from omnistage.v1 import coordinator_pb2 as cpb
from services.gateway.audio_files import StreamedFile
from services.gateway.protocol import SSE_DONE, error_body, sse
from services.gateway.speech import ChatJob, chat_chunk, chat_completion, completion_id, refused

log = logging.getLogger("omnistage.gateway")

Events = AsyncIterator[cpb.GenerateEvent]


@dataclass
class Primed:
    """A reply's stream read up to its first content: the events read so far, the rest still
    in `call`, and when the first audio came (None: not yet)."""

    call: Events
    events: list[cpb.GenerateEvent]
    started: float
    first_audio_ms: float | None = None
    fields: tuple[tuple[str, str], ...] = field(default=())

    async def rest(self) -> Events:
        """Every event: those read while priming, then the stream's others (errors with their
        HTTP field named)."""
        for event in self.events:
            yield event
        try:
            async for event in self.call:
                if event.HasField("audio") and self.first_audio_ms is None:
                    self.first_audio_ms = (time.perf_counter() - self.started) * 1e3
                yield event
        except OmniError as err:
            raise refused(err, self.fields) from None

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call.aclose()  # type: ignore[attr-defined]


async def prime(
    call: Events, started: float, until: tuple[str, ...], fields: tuple[tuple[str, str], ...]
) -> Primed:
    """Read `call` up to its first event of a kind in `until` (or its result); a refusal on the
    way is raised, with its HTTP field named, and the call closed."""
    primed = Primed(call, [], started, fields=fields)
    try:
        async for event in call:
            primed.events.append(event)
            kind = event.WhichOneof("event")
            if kind == "audio":
                primed.first_audio_ms = (time.perf_counter() - started) * 1e3
            if kind in until or kind == "result":
                return primed
    except OmniError as err:
        await primed.close()
        raise refused(err, fields) from None
    except BaseException:
        await primed.close()
        raise
    return primed


def sample_rate_of(primed: Primed) -> int:
    """The reply's sample rate, from its first audio chunk or its result."""
    for event in primed.events:
        if event.HasField("audio"):
            return event.audio.sample_rate
        if event.HasField("result"):
            return event.result.sample_rate
    raise OmniError("the coordinator's stream ended without audio", grpc.StatusCode.DATA_LOSS)


async def speech_body(primed: Primed, response_format: str) -> AsyncIterator[bytes]:
    """The audio body in `response_format`, each chunk's bytes as soon as the format has them
    (audio_files.py: wav, pcm and mp3 stream, flac comes whole at the end)."""
    try:
        with reply_file(primed, response_format) as out:
            if head := out.start():
                yield head
            async for event in primed.rest():
                if event.HasField("audio") and (data := out.feed(event.audio.data)):
                    yield data
            if tail := out.finish():
                yield tail
    except OmniError as err:  # the status went out: the body ends short, and the log says why
        log.warning("speech reply failed after its first audio: %s", err.message)
    finally:
        await primed.close()


async def speech_sse(primed: Primed, response_format: str) -> AsyncIterator[bytes]:
    """OpenAI's speech events: `speech.audio.delta` (base64) as audio comes, then
    `speech.audio.done`; a failure is an `error` event. Deltas are PCM16 for wav and pcm, the
    file's bytes for mp3 and flac (flac's in one delta at the end)."""
    samples = 0

    def delta(data: bytes) -> bytes:
        return sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

    try:
        with reply_file(primed, "pcm" if response_format == "wav" else response_format) as out:
            async for event in primed.rest():
                if event.HasField("audio"):
                    samples += len(event.audio.data) // 2
                    if data := out.feed(event.audio.data):
                        yield delta(data)
                elif event.HasField("result"):
                    if data := out.finish():
                        yield delta(data)
                    result, first_ms = event.result, primed.first_audio_ms
                    done = {
                        "type": "speech.audio.done",
                        "samples": samples,
                        "sample_rate": result.sample_rate,
                    }
                    yield sse({**done, "text": result.text, "first_audio_ms": first_ms})
        yield SSE_DONE
    except OmniError as err:
        _, body, _ = error_body(err)
        yield sse({"type": "error", **body})
    finally:
        await primed.close()


def reply_file(primed: Primed, response_format: str) -> StreamedFile:
    """The reply's body in `response_format` (raw PCM needs no sample rate: none is asked)."""
    return StreamedFile(response_format, 0 if response_format == "pcm" else sample_rate_of(primed))


async def chat_sse(primed: Primed, job: ChatJob) -> AsyncIterator[bytes]:
    """The streamed chat reply: `chat.completion.chunk`s whose `delta.content` is the text and
    `delta.audio.data` the audio (base64 PCM16) as each comes, then `[DONE]`."""
    cid, audio_id = completion_id(), f"audio-{uuid.uuid4().hex}"

    def data(delta: dict[str, object]) -> bytes:
        return sse_data(chat_chunk(cid, job.model, delta))

    try:
        yield data({"role": "assistant", "content": ""})
        async for event in primed.rest():
            kind = event.WhichOneof("event")
            if kind == "text":
                yield data({"content": event.text.text})
            elif kind == "audio":
                chunk = base64.b64encode(event.audio.data).decode()
                # sample_rate: omnistage's (OpenAI's pcm16 is 24 kHz; a model may differ).
                audio = {
                    "id": audio_id,
                    "data": chunk,
                    "transcript": "",
                    "sample_rate": event.audio.sample_rate,
                }
                yield data({"audio": audio})
            elif kind == "result":
                last = chat_chunk(cid, job.model, {}, finish="stop")
                last["first_audio_ms"] = primed.first_audio_ms
                yield sse_data(last)
        yield SSE_DONE
    except OmniError as err:
        _, body, _ = error_body(err)
        yield sse_data(body)
    finally:
        await primed.close()


def sse_data(payload: dict[str, object]) -> bytes:
    """One unnamed server-sent event, as OpenAI's chat streams send them."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def chat_whole(primed: Primed, job: ChatJob) -> dict[str, object]:
    """The non-streamed chat reply (chat.completion)."""
    text: list[str] = []
    pcm = bytearray()
    result: cpb.Result | None = None
    try:
        async for event in primed.rest():
            kind = event.WhichOneof("event")
            if kind == "text":
                text.append(event.text.text)
            elif kind == "audio":
                pcm += event.audio.data
            elif kind == "result":
                result = event.result
    finally:
        await primed.close()
    if result is None:
        raise OmniError("the coordinator's stream ended without a result", grpc.StatusCode.DATA_LOSS)
    reply = chat_completion(job, result.text or "".join(text), bytes(pcm), result.sample_rate)
    reply["first_audio_ms"] = primed.first_audio_ms
    return reply
