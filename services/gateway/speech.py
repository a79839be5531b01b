"""OpenAI's audio APIs in omnistage's terms, for models that write and speak (Qwen2.5-Omni):
a JSON body becomes one chat GenerateRequest, the reply's PCM16 chunks become a WAV or raw PCM
body, SSE events or chat completion chunks.

`POST /v1/audio/speech` (OpenAI's fields): `input` (required: the text the model answers,
aloud; Qwen2.5-Omni speaks its reply to it, it is not a reader), `model`, `voice` (a speaker
of the model, e.g. "Chelsie"; absent: the model's default), `response_format` ("wav", the
default here, "pcm": 16-bit mono little-endian at 24 kHz, "mp3" or "flac"; opus and aac need
an encoder this server does not carry: 400; audio_files.py says how each streams),
`speed` (1.0 only), `stream_format` ("audio": the body streams as it is spoken; "sse":
`speech.audio.delta` events, then `speech.audio.done`; their audio is PCM16 for wav and pcm,
the file's own bytes for mp3 and flac).

`POST /v1/chat/completions`: `messages` (a conversation of system, user and assistant turns,
the last the user's; user turns may hold `input_audio` and `image_url` data-URL parts:
chat_messages.py), `modalities` (["text"] or ["text", "audio"]), `audio` ({voice, format}: "wav",
"pcm16", "mp3" or "flac"; streamed replies are pcm16, as OpenAI's), `stream`, `max_completion_tokens` (or
`max_tokens`), `seed`; sampling fields (temperature, top_p, ...) are accepted and unused.

Both take omnistage's `seed` (default 0, as the SDK's) and `options` (the family's options,
e.g. {"talker_max_new_tokens": 200}). A wrong field is 400 with it named in `param`.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from omni_common.chat import chat_request
from omni_common.errors import OmniError
from omnistage.v1 import coordinator_pb2 as cpb
from services.gateway.audio_files import whole_file
from services.gateway.chat_messages import conversation
from services.gateway.protocol import (
    MAX_SEED,
    BadField,
    FieldError,
    blame,
    integer,
    number,
    shown,
    text_field,
    typed,
)

SPEECH_FORMATS = ("wav", "pcm", "mp3", "flac")
CHAT_FORMATS = {"wav": "wav", "pcm16": "pcm", "mp3": "mp3", "flac": "flac"}  # OpenAI's name: ours
UNSERVED_FORMATS = ("opus", "aac")
MAX_NEW_TOKENS = 8192

# Which HTTP field a coordinator's refusal is about (see protocol.blame), per route.
SPEECH_FIELDS = (
    ("unknown model", "model"),
    ("unknown speaker", "voice"),
    ("option speaker", "voice"),
    ("prompt", "input"),
    ("option", "options"),
)
CHAT_FIELDS = (
    ("unknown model", "model"),
    ("unknown speaker", "audio.voice"),
    ("option speaker", "audio.voice"),
    ("prompt", "messages"),
    ("input audio", "messages"),
    ("input image", "messages"),
    ("a message shows", "messages"),
    ("the messages", "messages"),
    ("the conversation", "messages"),
    ("option max_new_tokens", "max_completion_tokens"),
    ("option", "options"),
)


@dataclass(frozen=True)
class SpeechJob:
    """A validated POST /v1/audio/speech: the request and how its audio travels."""

    request: cpb.GenerateRequest
    response_format: str  # one of SPEECH_FORMATS
    sse: bool


@dataclass(frozen=True)
class ChatJob:
    """A validated POST /v1/chat/completions."""

    request: cpb.GenerateRequest
    model: str
    speaks: bool
    audio_format: str  # a key of CHAT_FORMATS (non-streamed replies' message.audio.data)
    stream: bool


def refused(err: OmniError, fields: tuple[tuple[str, str], ...]) -> OmniError:
    """A coordinator's refusal with its field named; a model that neither writes nor speaks
    (it has no "audio" option: an image model) is said so, about `model`."""
    if err.code == grpc.StatusCode.INVALID_ARGUMENT and "has no option 'audio'" in err.message:
        return FieldError("model", f"this model does not write or speak ({err.message})", err.code)
    return blame(err, fields)


def _options(doc: dict[str, Any], name: str = "options") -> dict[str, str]:
    value = typed(doc, name, dict, "an object of option names to values")
    options: dict[str, str] = {}
    for key, item in (value or {}).items():
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            what = f"option {text_field(name, key)[:64]!r}"
            raise BadField(name, f"{what} must be a string or number, not {shown(item)}")
        if key == "audio":  # the route says whether the reply is spoken (speech; modalities)
            raise BadField(name, "option audio is the route's: use modalities (chat) or /v1/audio/speech")
        options[text_field(name, key)] = text_field(name, str(item))
    return options


def _voice(doc: dict[str, Any], name: str, field: str) -> str | None:
    voice = typed(doc, name, str, "a string")
    if voice is not None and not voice:
        raise BadField(field, f"{field} must name one of the model's speakers, not an empty string")
    return voice


def speech_job(doc: dict[str, Any]) -> SpeechJob:
    """Validate a POST /v1/audio/speech body (see the module's docstring)."""
    text = typed(doc, "input", str, "a string")
    if not text or not text.strip():
        raise BadField("input", "input is required: the text the model answers aloud")
    model = typed(doc, "model", str, "a string") or ""
    voice = _voice(doc, "voice", "voice")
    response_format = typed(doc, "response_format", str, "a string") or "wav"
    if response_format in UNSERVED_FORMATS:
        raise BadField(
            "response_format",
            f"response_format {response_format} needs an encoder this server does not carry; "
            "ask for wav, pcm, mp3 or flac",
        )
    if response_format not in SPEECH_FORMATS:
        raise BadField(
            "response_format", f"response_format must be wav, pcm, mp3 or flac, not {response_format[:40]!r}"
        )
    speed = number(doc, "speed")
    if speed is not None and speed != 1.0:
        raise BadField("speed", "speed must be 1.0: this model speaks at its own pace")
    if typed(doc, "instructions", str, "a string"):
        raise BadField("instructions", "instructions are not supported by this model")
    stream_format = typed(doc, "stream_format", str, "a string") or "audio"
    if stream_format not in ("audio", "sse"):
        raise BadField("stream_format", f"stream_format must be audio or sse, not {stream_format[:40]!r}")
    seed = integer(doc, "seed", 0, MAX_SEED) or 0
    request = chat_request(
        text, speaker=voice, model=model, seed=seed, audio_format="pcm16", options=_options(doc)
    )
    return SpeechJob(request, response_format, stream_format == "sse")


def chat_job(doc: dict[str, Any]) -> ChatJob:
    """Validate a POST /v1/chat/completions body (see the module's docstring)."""
    talk = conversation(doc)
    model = typed(doc, "model", str, "a string") or ""
    modalities = typed(doc, "modalities", list, "an array") or ["text"]
    known = all(isinstance(m, str) for m in modalities) and not set(modalities) - {"text", "audio"}
    if not known or "text" not in modalities:
        raise BadField("modalities", 'modalities must be ["text"] or ["text", "audio"]')
    speaks = "audio" in modalities
    stream = typed(doc, "stream", bool, "true or false") or False
    audio = typed(doc, "audio", dict, "an object {voice, format}") or {}
    if speaks and not audio:
        raise BadField("audio", 'audio ({"voice": ..., "format": ...}) is required with the audio modality')
    voice = _voice(audio, "voice", "audio.voice") if isinstance(audio.get("voice"), str) else None
    if audio.get("voice") is not None and voice is None:
        raise BadField("audio.voice", f"audio.voice must be a string, not {shown(audio.get('voice'))}")
    audio_format = audio.get("format", "pcm16" if stream else "wav")
    if audio_format not in CHAT_FORMATS:
        raise BadField(
            "audio.format", f"audio.format must be wav, pcm16, mp3 or flac, not {shown(audio_format)}"
        )
    if stream and speaks and audio_format != "pcm16":
        raise BadField("audio.format", "a streamed reply's audio is pcm16 (as OpenAI's)")
    if (integer(doc, "n", 1, 1) or 1) != 1:
        raise BadField("n", "n must be 1")
    caps = [integer(doc, name, 1, MAX_NEW_TOKENS) for name in ("max_completion_tokens", "max_tokens")]
    options = _options(doc)
    if caps[0] or caps[1]:
        options["max_new_tokens"] = str(caps[0] or caps[1])
    seed = integer(doc, "seed", 0, MAX_SEED) or 0
    request = chat_request(
        talk.messages or talk.prompt,
        audio=talk.audios,
        images=talk.images,
        speak=speaks,
        speaker=voice,
        model=model,
        seed=seed,
        audio_format="pcm16",
        options=options,
    )
    return ChatJob(request, model, speaks, audio_format, stream)


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk` of a streamed reply."""
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def chat_completion(job: ChatJob, text: str, pcm: bytes, sample_rate: int) -> dict[str, Any]:
    """The non-streamed reply: one message, its audio (if spoken) whole in `message.audio.data`."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if job.speaks:
        data = whole_file(pcm, sample_rate, CHAT_FORMATS[job.audio_format])
        message["audio"] = {
            "id": f"audio-{uuid.uuid4().hex}",
            "data": base64.b64encode(data).decode(),
            "expires_at": int(time.time()) + 3600,
            "transcript": text,
        }
    return {
        "id": completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }
