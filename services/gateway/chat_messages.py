"""The `messages` of POST /v1/chat/completions in omnistage's terms: a conversation of system,
user and assistant turns whose user turns may hold media, as OpenAI's chat API sends them.

Content is a string or a list of parts: {"type": "text", "text"}, {"type": "input_audio",
"input_audio": {"data": base64, "format": "wav", "flac" or "mp3"}} and {"type": "image_url",
"image_url": {"url": "data:image/...;base64,..."}}. Images come as data URLs only: this server
never fetches a URL (a request must not make it reach into the network). The media's bytes are
checked by the coordinator (not audio, 0 s, too long, a rate the model does not hear: 400);
here only their shape and their size.

One user turn of text alone stays a plain prompt (what the gateway sent before conversations).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from services.gateway.protocol import BadField, shown, text_field, typed

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256
MAX_MEDIA_BYTES = 32 << 20  # decoded, all media of one request (the coordinator allows 48 MiB)
AUDIO_FORMATS = ("wav", "flac", "mp3")  # the file's own bytes say which (the SDK reads them)


@dataclass
class Conversation:
    """What `chat_request` takes: a prompt (one user turn of text) or messages, and the media
    their parts index."""

    prompt: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    audios: list[bytes] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)

    @property
    def media_bytes(self) -> int:
        return sum(len(item) for item in (*self.audios, *self.images))


def conversation(doc: dict[str, Any]) -> Conversation:
    """Validate `messages` (400 naming "messages" for a wrong one)."""
    messages = typed(doc, "messages", list, "an array of messages")
    if not messages:
        raise BadField("messages", "messages is required: at least one user message")
    if len(messages) > MAX_MESSAGES:
        raise BadField("messages", f"at most {MAX_MESSAGES} messages; got {len(messages)}")
    found = Conversation()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadField(
                "messages", f"message {i} must be an object whose role is system, user or assistant"
            )
        found.messages.append(
            {"role": message["role"], "content": _content(message.get("content"), i, found)}
        )
    if messages[-1].get("role") != "user":
        raise BadField("messages", "the last message must be the user's (the reply answers it)")
    if found.media_bytes > MAX_MEDIA_BYTES:
        raise BadField(
            "messages", f"the media are {found.media_bytes} bytes in all; the limit is {MAX_MEDIA_BYTES}"
        )
    only = found.messages[0]["content"] if len(found.messages) == 1 else None
    if isinstance(only, str):  # one user turn of text: the plain prompt, as before conversations
        found.prompt, found.messages = only, []
    return found


def _content(content: object, index: int, found: Conversation) -> str | list[dict[str, Any]]:
    """A message's content: its text, or its parts with media replaced by their indices."""
    if isinstance(content, str):
        if not content.strip():
            raise BadField("messages", f"message {index}'s content must be non-empty")
        return text_field("messages", content)
    if not isinstance(content, list) or not content:
        raise BadField(
            "messages", f"message {index}'s content must be a string or a non-empty array of parts"
        )
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": text_field("messages", part["text"])})
        elif kind == "input_audio":
            found.audios.append(_audio(part.get("input_audio"), index))
            parts.append({"type": "audio", "audio": len(found.audios) - 1})
        elif kind == "image_url":
            found.images.append(_image(part.get("image_url"), index))
            parts.append({"type": "image", "image": len(found.images) - 1})
        else:
            raise BadField(
                "messages",
                f"message {index}: a part must be text, input_audio or image_url, not {shown(kind)}",
            )
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _audio(value: object, index: int) -> bytes:
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise BadField("messages", f"message {index}: input_audio must be {{data: base64, format}}")
    if value.get("format") not in AUDIO_FORMATS:
        raise BadField(
            "messages",
            f"message {index}: input_audio.format must be wav, flac or mp3, not {shown(value.get('format'))}",
        )
    return _base64(value["data"], index, "input_audio.data")


def _image(value: object, index: int) -> bytes:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise BadField("messages", f"message {index}: image_url must be {{url: a data URL}}")
    head, comma, data = url.partition(",")
    if not (url.startswith("data:image/") and head.endswith(";base64") and comma):
        raise BadField(
            "messages",
            f"message {index}: image_url must be a data URL (data:image/...;base64,...); "
            "this server never fetches URLs",
        )
    return _base64(data, index, "image_url")


def _base64(data: str, index: int, what: str) -> bytes:
    if len(data) > MAX_MEDIA_BYTES * 4 // 3 + 4:
        raise BadField("messages", f"message {index}: {what} is over {MAX_MEDIA_BYTES} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadField("messages", f"message {index}: {what} is not valid base64") from None
