"""Qwen2.5-Omni through the HTTP gateway with OpenAI's own Python client: streamed speech
decodes (the standard library's `wave`) and equals the SDK's reply within PCM16 rounding;
streamed chat's text and audio deltas add up to the non-streamed reply; the first audio
arrives before the last text; a client that leaves mid-speech frees every lease; an unknown
voice is 400 about `voice`. (test_gateway_speech.py pins the translation itself, hostile bodies
included, over a scripted coordinator; this file needs the tiny Qwen2.5-Omni fixture to load,
as tests/integration/test_qwen_omni.py does.)"""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omni_common.client import Client
from omni_common.cluster import free_port

from .conftest import InProcessCluster, InProcessGateway

PROMPT = "Tell me a short story."
CAPS = {"max_new_tokens": 16, "talker_max_new_tokens": 60}
LONG = {"max_new_tokens": 200, "talker_max_new_tokens": 200}  # several audio chunks
CANCELLED = ("omnistage_coordinator_requests_failed_total", frozenset({("code", "CANCELLED")}))


@pytest.fixture(scope="module")
def omni(omni_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(omni_model, coordinator_options={"metrics_port": free_port()})
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def gateway(omni: InProcessCluster) -> Iterator[InProcessGateway]:
    running = InProcessGateway(omni.loop, omni.coordinator)
    yield running
    running.stop()


def client_of(gateway: InProcessGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


def sdk_reply(omni: InProcessCluster, seed: int = 0, **options: object):
    with Client(omni.coordinator) as sdk:
        return sdk.speak(PROMPT, seed=seed, options={**CAPS, **options})


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32767


def test_streamed_speech_decodes_and_equals_the_sdks_reply(omni, gateway) -> None:
    with client_of(gateway).audio.speech.with_streaming_response.create(
        model="", input=PROMPT, voice="Chelsie", response_format="wav", extra_body={"options": CAPS}
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert float(response.headers["x-first-audio-ms"]) > 0
        body = b"".join(response.iter_bytes())
    with wave.open(io.BytesIO(body)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24_000)
        frames = wav.readframes(len(body))  # a streamed WAV's header says "to the end"
    expected = sdk_reply(omni)
    heard = pcm16(frames)
    assert len(heard) == len(expected.audio) > 0
    assert float(np.abs(heard - expected.audio).max()) <= 0.5 / 32767 + 1e-7


def test_speech_as_sse_and_raw_pcm_carry_the_same_samples(gateway) -> None:
    body = {"input": PROMPT, "voice": "Chelsie", "options": CAPS}
    raw = httpx.post(f"{gateway.url}/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=120)
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
    events = sse_payloads(
        httpx.post(f"{gateway.url}/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=120)
    )
    deltas = b"".join(base64.b64decode(e["audio"]) for e in events if e.get("type") == "speech.audio.delta")
    done = [e for e in events if e.get("type") == "speech.audio.done"]
    assert deltas == raw.content and done[0]["samples"] == len(raw.content) // 2
    assert done[0]["first_audio_ms"] > 0


def sse_payloads(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    out = []
    for line in response.text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def test_streamed_chat_deltas_add_up_to_the_whole_reply(gateway) -> None:
    client = client_of(gateway)
    common: dict[str, Any] = {
        "model": "",
        "messages": [{"role": "user", "content": PROMPT}],
        "modalities": ["text", "audio"],
        "extra_body": {"options": CAPS, "seed": 3},
    }
    whole = client.chat.completions.create(audio={"voice": "Chelsie", "format": "pcm16"}, **common)
    message = whole.choices[0].message
    assert message.audio is not None and message.content
    text, audio = [], []
    for chunk in client.chat.completions.create(
        audio={"voice": "Chelsie", "format": "pcm16"}, stream=True, **common
    ):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        if delta.audio is not None and delta.audio.data:  # OpenAI's ChoiceDeltaAudio
            audio.append(base64.b64decode(delta.audio.data))
    assert "".join(text) == message.content == message.audio.transcript
    assert b"".join(audio) == base64.b64decode(message.audio.data)
    assert len(audio) >= 1


def test_a_text_only_chat_has_no_audio(gateway) -> None:
    reply = client_of(gateway).chat.completions.create(
        model="", messages=[{"role": "user", "content": PROMPT}], extra_body={"options": CAPS, "seed": 3}
    )
    assert reply.choices[0].message.content and reply.choices[0].message.audio is None


def test_the_first_audio_comes_before_the_last_text(gateway) -> None:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "pcm16"},
        "stream": True,
        "options": LONG,
    }
    kinds = []
    for event in sse_payloads(httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=300)):
        delta = event["choices"][0]["delta"] if event.get("choices") else {}
        if delta.get("content"):
            kinds.append("text")
        if delta.get("audio"):
            kinds.append("audio")
    last_text = len(kinds) - 1 - kinds[::-1].index("text")
    assert "audio" in kinds[:last_text], "no audio arrived before the reply's last text"


def cancelled(omni: InProcessCluster) -> float:
    return omni.metrics("coordinator").get(CANCELLED, 0.0)


def test_a_client_that_leaves_mid_speech_frees_every_lease(omni, gateway) -> None:
    before = cancelled(omni)
    body = {"input": PROMPT, "voice": "Chelsie", "options": {**LONG, "talker_max_new_tokens": 2000}}
    with httpx.stream("POST", f"{gateway.url}/v1/audio/speech", json=body, timeout=120) as response:
        assert response.status_code == 200
        next(response.iter_raw())  # the header and the first audio came; now leave
    deadline = time.monotonic() + 20
    while cancelled(omni) < before + 1 or any(omni.live_leases().values()):
        assert time.monotonic() < deadline, f"leases left: {omni.live_leases()}"
        time.sleep(0.05)


def test_an_unknown_voice_is_400_about_voice_from_the_thinkers_check(gateway) -> None:
    body = {"input": PROMPT, "voice": "Nobody", "options": CAPS}
    response = httpx.post(f"{gateway.url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "voice"
    assert "unknown speaker" in response.json()["error"]["message"]


def test_models_say_what_they_take_and_return(gateway) -> None:
    (model,) = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    assert model["outputs"] == ["text", "audio"] and model["inputs"] == ["text", "audio", "image", "video"]
    assert model["endpoints"] == ["/v1/chat/completions", "/v1/audio/speech"]
    assert "speaker" in {option["name"] for option in model["options"]}
