"""The gateway's speech, chat and edit routes with OpenAI's own Python client, over a real
gRPC coordinator that replies from a script (scripted_coordinator.py): streamed speech decodes
with the standard library's `wave` and equals the SDK's reply within PCM16 rounding, FLAC
exactly and MP3 within its codec's error (soundfile decodes them); streamed
chat's text and audio deltas add up to the non-streamed reply, and audio comes before the last
text; an edit returns the SDK's pixels; a client that leaves mid-speech closes the call; hostile
bodies are 4xx with the field named and the gateway stays up.

(test_gateway_omni.py runs the same routes over the real Qwen2.5-Omni tiny cluster.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile
from PIL import Image

from omni_common.client import Client

from .conftest import InProcessGateway
from .scripted_coordinator import EDITOR, MODEL, ScriptedCoordinator, serve_scripted

PROMPT = "Tell me a short story."
CHELSIE = {"voice": "Chelsie", "format": "pcm16"}


class Scripted:
    """The scripted coordinator and a gateway before it, on one event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coordinator = ScriptedCoordinator()
        self.server, self.address = asyncio.run_coroutine_threadsafe(
            serve_scripted(self.coordinator), self.loop
        ).result(30)
        self.gateway = InProcessGateway(self.loop, self.address, max_images=4)

    def stop(self) -> None:
        self.gateway.stop()
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    running = Scripted()
    yield running
    running.stop()


def client_of(scripted: Scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted.gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32767


def test_streamed_speech_decodes_and_equals_the_sdks_reply(scripted) -> None:
    with client_of(scripted).audio.speech.with_streaming_response.create(
        model=MODEL, input=PROMPT, voice="Ethan", response_format="wav", extra_body={"seed": 4}
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert float(response.headers["x-first-audio-ms"]) > 0
        body = b"".join(response.iter_bytes())
    with wave.open(io.BytesIO(body)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24_000)
        frames = wav.readframes(len(body))  # a streamed WAV's header says "to the end"
    with Client(scripted.address) as sdk:
        expected = sdk.speak(PROMPT, seed=4, speaker="Ethan")
    heard = pcm16(frames)
    assert len(heard) == len(expected.audio) > 0
    assert float(np.abs(heard - expected.audio).max()) <= 0.5 / 32767 + 1e-7


def soundfile_pcm16(data: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 24_000
    return samples


def snr_db(heard: np.ndarray, sent: np.ndarray) -> float:
    n = min(len(heard), len(sent))
    signal, error = sent[:n].astype(np.float64), heard[:n].astype(np.float64) - sent[:n]
    return float(10 * np.log10((signal**2).sum() / max((error**2).sum(), 1e-9)))


def test_flac_and_mp3_speech_decode_to_the_sdks_reply(scripted) -> None:  # type: ignore[no-untyped-def]
    with Client(scripted.address) as sdk:
        reply = sdk.speak(PROMPT, seed=6, speaker="Ethan", audio_format="pcm16")
    sent = np.round(reply.audio * 32767).astype(np.int16)  # the wire's PCM16
    bodies = {}
    for response_format, media_type in (("flac", "audio/flac"), ("mp3", "audio/mpeg")):
        with client_of(scripted).audio.speech.with_streaming_response.create(
            model=MODEL, input=PROMPT, voice="Ethan", response_format=response_format, extra_body={"seed": 6}
        ) as response:
            assert response.headers["content-type"] == media_type
            bodies[response_format] = b"".join(response.iter_bytes())
    np.testing.assert_array_equal(soundfile_pcm16(bodies["flac"]), sent)  # lossless
    heard = soundfile_pcm16(bodies["mp3"])  # streamed: the encoder's delay (< 2 frames) first
    delay = max(range(0, 2 * 576), key=lambda lag: snr_db(heard[lag:], sent))
    assert snr_db(heard[delay:], sent) > 20 and len(heard) - delay >= len(sent)


def test_chat_replies_in_flac_and_mp3_are_whole_files_of_the_reply(scripted) -> None:  # type: ignore[no-untyped-def]
    client = client_of(scripted)
    pcm = client.chat.completions.create(**chat_args(modalities=["text", "audio"], audio=CHELSIE))
    assert pcm.choices[0].message.audio is not None
    sent = np.frombuffer(base64.b64decode(pcm.choices[0].message.audio.data), "<i2")
    files = {}
    for audio_format in ("flac", "mp3"):
        reply = client.chat.completions.create(
            **chat_args(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": audio_format})
        )
        assert reply.choices[0].message.audio is not None
        files[audio_format] = soundfile_pcm16(base64.b64decode(reply.choices[0].message.audio.data))
    np.testing.assert_array_equal(files["flac"], sent)
    assert len(files["mp3"]) == len(sent) and snr_db(files["mp3"], sent) > 20  # gapless: no delay


def sse_payloads(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [
        json.loads(line[5:])
        for line in response.text.splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]


def test_speech_as_sse_and_as_raw_pcm_carry_the_same_samples(scripted) -> None:
    url = f"{scripted.gateway.url}/v1/audio/speech"
    body = {"input": PROMPT, "voice": "Chelsie"}
    raw = httpx.post(url, json={**body, "response_format": "pcm"}, timeout=60)
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
    events = sse_payloads(httpx.post(url, json={**body, "stream_format": "sse"}, timeout=60))
    deltas = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    (done,) = [e for e in events if e["type"] == "speech.audio.done"]
    assert deltas == raw.content and done["samples"] == len(raw.content) // 2 > 0
    assert done["first_audio_ms"] > 0


def chat_args(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **extra}


def test_streamed_chat_deltas_add_up_to_the_whole_reply_audio_before_the_last_text(scripted) -> None:
    client = client_of(scripted)
    whole = client.chat.completions.create(**chat_args(modalities=["text", "audio"], audio=CHELSIE))
    message = whole.choices[0].message
    assert message.audio is not None and message.content == message.audio.transcript
    kinds, text, audio = [], [], []
    for chunk in client.chat.completions.create(
        **chat_args(modalities=["text", "audio"], audio=CHELSIE, stream=True)
    ):
        delta = chunk.choices[0].delta
        if delta.content:
            kinds.append("text")
            text.append(delta.content)
        if delta.audio is not None and delta.audio.data:  # OpenAI's ChoiceDeltaAudio
            kinds.append("audio")
            audio.append(base64.b64decode(delta.audio.data))
    assert "".join(text) == message.content
    assert b"".join(audio) == base64.b64decode(message.audio.data)
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert "audio" in kinds[:last_text]


def test_a_wav_reply_is_a_whole_wav_file_and_a_text_only_chat_has_no_audio(scripted) -> None:
    client = client_of(scripted)
    spoken = client.chat.completions.create(
        **chat_args(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"})
    )
    assert spoken.choices[0].message.audio is not None
    with wave.open(io.BytesIO(base64.b64decode(spoken.choices[0].message.audio.data))) as wav:
        assert wav.getnframes() > 0 and wav.getframerate() == 24_000
    written = client.chat.completions.create(**chat_args())
    assert written.choices[0].message.content == spoken.choices[0].message.content
    assert written.choices[0].message.audio is None


def test_a_client_that_leaves_mid_speech_closes_its_call(scripted) -> None:
    coordinator = scripted.coordinator
    before = coordinator.cancelled
    scripted.loop.call_soon_threadsafe(lambda: setattr(coordinator, "gate", asyncio.Event()))
    try:
        with httpx.stream(
            "POST", f"{scripted.gateway.url}/v1/audio/speech", json={"input": PROMPT}, timeout=60
        ) as response:
            assert response.status_code == 200
            next(response.iter_raw())  # the first audio came, the reply is held; now leave
        deadline = time.monotonic() + 10
        while coordinator.cancelled < before + 1 or coordinator.open_calls:
            assert time.monotonic() < deadline, "the call of a client that left stayed open"
            time.sleep(0.05)
    finally:  # (a reply still held goes on, so that nothing waits forever)
        gate = coordinator.gate
        scripted.loop.call_soon_threadsafe(lambda: setattr(coordinator, "gate", None))
        scripted.loop.call_soon_threadsafe(gate.set)


def png(width: int = 32, height: int = 32) -> bytes:
    pixels = (np.arange(width * height * 3) % 251).astype(np.uint8).reshape(height, width, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_edit_gets_the_sdks_pixels(scripted) -> None:
    source = png()
    response = client_of(scripted).images.edit(
        model=MODEL, image=("in.png", source, "image/png"), prompt="make it red", extra_body={"seed": 9}
    )
    with Client(scripted.address) as sdk:
        expected = sdk.generate("make it red", images=[source], seed=9, image_format="png")
    got = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json or "")))
    np.testing.assert_array_equal(np.asarray(got.convert("RGB")), np.asarray(expected.convert("RGB")))


def test_a_streamed_edit_sends_its_image_as_an_event(scripted) -> None:
    files = {"image[]": ("in.png", png(), "image/png")}
    data = {"prompt": "make it red", "stream": "true", "seed": "9"}
    response = httpx.post(f"{scripted.gateway.url}/v1/images/edits", files=files, data=data, timeout=60)
    events = sse_payloads(response)
    assert events[-1]["type"] == "image_generation.completed" and events[-1]["b64_json"]


def edit(scripted: Scripted, image: bytes, **fields: str) -> httpx.Response:
    files = {"image": ("in.png", image, "image/png")}
    return httpx.post(
        f"{scripted.gateway.url}/v1/images/edits",
        files=files,
        data={"prompt": "make it red", **fields},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("case", "param"),
    [
        ("not an image", "image"),
        ("50 MB", "image"),
        ("n over the limit", "n"),
        ("n not a number", "n"),
        ("no image", "image"),
        ("bad size", "size"),
    ],
)
def test_hostile_edits_are_400_with_the_field_named(scripted, case, param) -> None:
    if case == "not an image":
        response = edit(scripted, b"%PDF-1.4 not an image")
    elif case == "50 MB":
        response = edit(scripted, png() + b"\0" * (50 << 20))
    elif case == "n over the limit":
        response = edit(scripted, png(), n="5")
    elif case == "n not a number":
        response = edit(scripted, png(), n="²")
    elif case == "bad size":
        response = edit(scripted, png(), size="²x²")
    else:
        response = httpx.post(
            f"{scripted.gateway.url}/v1/images/edits", files={"x": ("a", b"b")}, data={"prompt": "p"}
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert httpx.get(f"{scripted.gateway.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("speech", {"input": PROMPT, "voice": "Nobody"}, "voice"),
        ("speech", {"input": ""}, "input"),
        ("speech", {"input": "   "}, "input"),
        ("speech", {"input": PROMPT, "response_format": "opus"}, "response_format"),
        ("speech", {"input": PROMPT, "speed": 1.5}, "speed"),
        ("speech", {"input": "\ud800"}, "input"),
        ("speech", {"input": PROMPT, "model": "\udfff"}, "model"),
        ("speech", {"input": PROMPT, "options": [1]}, "options"),
        ("speech", {"input": PROMPT, "options": {"audio": 0}}, "options"),
        ("chat", chat_args(modalities=["text", "audio"], audio={"voice": "Nobody"}), "audio.voice"),
        ("chat", chat_args(modalities=["text", "audio"]), "audio"),
        (
            "chat",
            chat_args(modalities=["text", "audio"], audio=CHELSIE, stream=True)
            | {"audio": {"format": "wav"}},
            "audio.format",
        ),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ("chat", chat_args(n=2), "n"),
        ("chat", chat_args(modalities=["audio"]), "modalities"),
        ("chat", chat_args(max_tokens=0), "max_tokens"),
    ],
)
def test_hostile_speech_and_chat_bodies_are_400_with_the_field_named(scripted, route, body, param) -> None:
    path = "/v1/audio/speech" if route == "speech" else "/v1/chat/completions"
    # json.dumps escapes "\ud800" as JSON allows (httpx's own encoder would refuse to send it).
    response = httpx.post(f"{scripted.gateway.url}{path}", content=json.dumps(body).encode(), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert httpx.get(f"{scripted.gateway.url}/health", timeout=10).status_code == 200


def test_models_say_what_they_take_and_return(scripted) -> None:
    models = {model.id: model for model in client_of(scripted).models.list().data}
    extra = models[MODEL].model_extra or {}
    assert extra["outputs"] == ["text", "audio"] and extra["inputs"] == ["text"]
    assert extra["endpoints"] == ["/v1/chat/completions", "/v1/audio/speech"]
    assert [option["name"] for option in extra["options"]] == ["speaker"]
    editor = models[EDITOR].model_extra or {}
    assert editor["endpoints"] == ["/v1/images/generations", "/v1/images/edits"] and editor["max_images"] == 4
