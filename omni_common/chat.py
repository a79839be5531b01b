"""Chat with models that write and speak (Qwen2.5-Omni): the request, and the reply as it
streams. What `Client.chat` / `Client.speak` use:

    with Client("127.0.0.1:50051") as client:
        for piece in client.chat("Tell me a story.", speaker="Ethan"):
            if isinstance(piece, TextDelta):
                print(piece.text, end="", flush=True)
            else:  # SpeechChunk: float32 samples at piece.sample_rate, playable at once
                player.write(piece.samples)
        reply = client.speak("Say hi.")  # the whole reply: reply.text, reply.audio, reply.save("hi.wav")
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from omni_common.audio import decode_audio, write_wav
from omni_common.errors import OmniError
from omni_common.media import AudioLike, ImageLike, Video, input_media
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2

AUDIO_FORMATS = {"pcm16": cpb.AUDIO_FORMAT_PCM16, "float32": cpb.AUDIO_FORMAT_FLOAT32}


@dataclass(frozen=True)
class TextDelta:
    """Text the reply gained."""

    text: str


@dataclass(frozen=True)
class SpeechChunk:
    """The next piece of the spoken reply: float32 samples in [-1, 1]."""

    samples: np.ndarray
    sample_rate: int
    offset: int  # samples before it


ChatPiece = TextDelta | SpeechChunk


@dataclass
class Reply:
    """A whole reply: its text, its audio (float32, empty when not spoken) and timings."""

    text: str
    audio: np.ndarray
    sample_rate: int
    request_id: str
    total_ms: float
    first_audio_ms: float | None = None  # from the request to the first SpeechChunk
    stage_ms: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate if self.sample_rate else 0.0

    @property
    def spoken(self) -> bool:
        """Whether the reply has audio (False for a text-only one: the `audio` option 0)."""
        return self.sample_rate > 0 and len(self.audio) > 0

    def save(self, path: str | Path) -> None:
        """The audio as a 16-bit mono WAV file; ValueError (and no file) for a text-only reply."""
        if not self.spoken:
            raise ValueError("the reply has no audio to save: it was not spoken (option audio=0)")
        write_wav(Path(path), self.audio, self.sample_rate)


Messages = Sequence[Mapping[str, Any]]


def chat_request(
    prompt: str | Messages,
    *,
    audio: bool | AudioLike | Sequence[AudioLike] = True,
    images: Sequence[ImageLike] = (),
    video: Video | Sequence[Video] = (),
    speak: bool | None = None,
    speaker: str | None = None,
    model: str = "",
    seed: int = 0,
    max_new_tokens: int | None = None,
    stream_audio: bool = True,
    audio_format: str = "float32",
    request_id: str = "",
    options: Mapping[str, object] | None = None,
) -> cpb.GenerateRequest:
    """The GenerateRequest of one chat turn: `prompt` (one user turn, after the input clips,
    images and videos) or a conversation (`messages`: dicts of "role" and "content", a string
    or a list of {"type": "text", "text": ...}, {"type": "audio", "audio": i}, {"type": "image",
    "image": i}, {"type": "video", "video": i} parts, i indexing `audio` / `images` / `video`).

    `audio`: input clips (a WAV or FLAC file's bytes or path, or (samples, rate)); a bool keeps
    its first meaning, whether the reply is spoken, which `speak` now says (options: the
    model's others, e.g. talker sampling). `video`: one Video (frames and fps) or several."""
    if audio_format not in AUDIO_FORMATS:
        raise ValueError(f"audio_format must be one of {sorted(AUDIO_FORMATS)}, not {audio_format!r}")
    clips: list[AudioLike] = []
    if isinstance(audio, bool):
        speak = audio if speak is None else speak
    elif isinstance(audio, (bytes, str, os.PathLike, tuple)):
        clips = [audio]
    else:
        clips = list(audio)
    spoken = True if speak is None else speak
    chosen: dict[str, object] = {"audio": int(spoken), "stream_audio": int(stream_audio), **(options or {})}
    if speaker is not None:
        chosen["speaker"] = speaker
    if max_new_tokens is not None:
        chosen["max_new_tokens"] = max_new_tokens
    params = stage_pb2.GenerationParams(
        model=model, seed=seed, options={name: str(value) for name, value in chosen.items()}
    )
    if isinstance(prompt, str):
        params.prompt = prompt
    else:
        params.messages.extend(chat_message(message) for message in prompt)
    return cpb.GenerateRequest(
        params=params,
        request_id=request_id,
        audio_format=AUDIO_FORMATS[audio_format],
        inputs=input_media(clips, images, [video] if isinstance(video, Video) else list(video)),
    )


def chat_message(message: Mapping[str, Any]) -> stage_pb2.ChatMessage:
    """One conversation message (see `chat_request`) as a ChatMessage; ValueError for a part
    of another shape."""
    content = message.get("content", "")
    if isinstance(content, str):
        return stage_pb2.ChatMessage(role=message["role"], parts=[stage_pb2.ChatPart(text=content)])
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(stage_pb2.ChatPart(text=part["text"]))
        elif kind == "audio":
            parts.append(stage_pb2.ChatPart(audio=int(part["audio"])))
        elif kind == "image":
            parts.append(stage_pb2.ChatPart(image=int(part["image"])))
        elif kind == "video":
            parts.append(stage_pb2.ChatPart(video=int(part["video"])))
        else:
            raise ValueError(f"a message part must be text, audio, image or video, not {kind!r}")
    return stage_pb2.ChatMessage(role=message["role"], parts=parts)


def chat_piece(event: cpb.GenerateEvent) -> ChatPiece | None:
    """The text or audio an event carries; None for other events."""
    kind = event.WhichOneof("event")
    if kind == "text":
        return TextDelta(event.text.text)
    if kind == "audio":
        chunk = event.audio
        return SpeechChunk(decode_audio(chunk.data, chunk.format), chunk.sample_rate, chunk.offset)
    return None


class ReplyBuilder:
    """Folds a chat's GenerateEvents into a Reply."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.request_id = ""
        self.text: list[str] = []
        self.audio: list[np.ndarray] = []
        self.first_audio_ms: float | None = None
        self.stage_ms: dict[str, float] = {}
        self.result: cpb.Result | None = None

    def add(self, event: cpb.GenerateEvent, now: float) -> ChatPiece | None:
        kind = event.WhichOneof("event")
        if kind == "accepted":
            self.request_id = event.accepted.request_id
        elif kind == "stage_finished":
            self.stage_ms[event.stage_finished.step] = event.stage_finished.wall_ms
        elif kind == "result":
            self.result = event.result
        piece = chat_piece(event)
        if isinstance(piece, TextDelta):
            self.text.append(piece.text)
        elif isinstance(piece, SpeechChunk):
            if piece.offset != sum(len(samples) for samples in self.audio):
                raise OmniError("audio chunks arrived out of order", grpc.StatusCode.DATA_LOSS)
            if self.first_audio_ms is None:
                self.first_audio_ms = (now - self.started) * 1e3
            self.audio.append(piece.samples)
        return piece

    def build(self) -> Reply:
        if self.result is None:
            raise OmniError("the stream ended without a result", grpc.StatusCode.DATA_LOSS)
        audio = np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)
        if len(audio) != self.result.audio_samples:
            raise OmniError("the reply's audio is incomplete", grpc.StatusCode.DATA_LOSS)
        return Reply(
            text=self.result.text,
            audio=audio,
            sample_rate=self.result.sample_rate,
            request_id=self.request_id,
            total_ms=self.result.total_ms,
            first_audio_ms=self.first_audio_ms,
            stage_ms=self.stage_ms,
        )
