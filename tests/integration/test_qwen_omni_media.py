"""Qwen2.5-Omni hears and sees, through real gRPC servers and shared memory: a reply to text
plus an audio clip, or text plus an image, equals transformers' processor + `generate` on the
same inputs bit for bit (text and waveform, fp32, CPU); hostile clips are INVALID_ARGUMENT with
a message that says what is wrong, and the service stays up; a conversation's turns equal
transformers' on the full history each turn while reusing the earlier turns' KV."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
from PIL import Image

from omni_common.audio_input import wav_bytes
from omni_common.chat import Reply, chat_message
from omni_common.client import Client
from omni_common.cluster import free_port
from omni_common.errors import InvalidArgument
from omni_common.models.qwen_omni.reference import reference_generate
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2
from tests.integration.conftest import InProcessCluster, InProcessGateway, scrape

PROMPT = "What is this?"
CAPS = {"max_new_tokens": 12, "talker_max_new_tokens": 40}


def clip(seconds: float = 1.0, rate: int = 16_000, seed: int = 0) -> bytes:
    """A 16-bit WAV of a tone with noise."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.1, t.shape)
    samples = np.clip(0.5 * np.sin(2 * np.pi * 440 * t) + noise, -1, 1)
    return wav_bytes(np.round(samples * 32767).astype(np.int16), rate)


def picture(width: int = 84, height: int = 56, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def omni(omni_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(omni_model, stage_options={"ar-encoder": {"metrics_port": free_port()}})
    running.start()
    yield running
    running.stop()


@pytest.mark.parametrize("media", ["audio", "image", "both"])
def test_a_reply_to_text_and_media_equals_the_processor_and_generate(
    omni: InProcessCluster, omni_model: Path, media: str
) -> None:
    audios = [clip()] if media in ("audio", "both") else []
    images = [picture()] if media in ("image", "both") else []
    with Client(omni.coordinator) as client:
        reply = client.speak(PROMPT, audio=audios, images=images, seed=5, stream_audio=False, options=CAPS)
    ref = reference_generate(
        omni_model,
        PROMPT,
        audios=audios,
        images=images,
        seed=5,
        thinker_max_new_tokens=12,
        talker_max_new_tokens=40,
    )
    assert reply.text == ref.text
    np.testing.assert_array_equal(reply.audio, ref.waveform.numpy())


def test_the_media_change_the_reply(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client:
        one = client.speak(PROMPT, audio=[clip(seed=1)], seed=5, speak=False, options=CAPS)
        other = client.speak(PROMPT, audio=[clip(seed=2)], seed=5, speak=False, options=CAPS)
        plain = client.speak(PROMPT, seed=5, speak=False, options=CAPS)
    assert len({one.text, other.text, plain.text}) > 1


def test_raw_pcm_with_its_rate_equals_the_same_samples_as_wav(omni: InProcessCluster) -> None:
    samples = np.random.default_rng(3).uniform(-0.5, 0.5, 16_000).astype(np.float32)
    with Client(omni.coordinator) as client:
        raw = client.speak(PROMPT, audio=(samples, 16_000), seed=5, speak=False, options=CAPS)
        wav = client.speak(PROMPT, audio=wav_bytes(samples, 16_000), seed=5, speak=False, options=CAPS)
    assert raw.text == wav.text


@pytest.mark.parametrize(
    ("audio", "message"),
    [
        (b"this is not audio at all", "not a WAV or FLAC file"),
        (wav_bytes(np.zeros(0, np.int16), 16_000), "no samples (0 s)"),
        (wav_bytes(np.zeros(3600 * 8000, np.uint8) + 128, 8000), "lasts 3600.0 s"),
        (clip(rate=44_100), "is 44100 Hz; qwen2.5-omni hears 16000 Hz"),
        (clip(seconds=31), "at most 30 s"),  # the fixture's window (the real one: 300 s)
    ],
    ids=["not-audio", "zero-seconds", "an-hour", "wrong-rate", "over-the-window"],
)
def test_hostile_audio_is_invalid_argument_and_the_service_stays_up(
    omni: InProcessCluster, audio: bytes, message: str
) -> None:
    with Client(omni.coordinator) as client:
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            client.speak(PROMPT, audio=audio, seed=5, speak=False, options=CAPS)
        assert client.speak(PROMPT, seed=5, speak=False, options=CAPS).text is not None


def test_raw_pcm_without_a_rate_and_too_many_images_are_refused(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client:
        bad = cpb.InputAudio(data=b"\0\0" * 100, format=cpb.AUDIO_INPUT_FORMAT_PCM16)
        request = cpb.GenerateRequest(params={"prompt": PROMPT}, inputs=[cpb.InputMedia(audio=bad)])
        with pytest.raises(InvalidArgument, match="raw PCM needs sample_rate"):
            list(client.stream(request))
        with pytest.raises(InvalidArgument, match="at most 8 input images"):
            client.speak(PROMPT, images=[picture()] * 9, speak=False, options=CAPS)


def test_messages_must_show_each_input_once(omni: InProcessCluster) -> None:
    turns = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "audio", "audio": 1}]}]
    with Client(omni.coordinator) as client:
        with pytest.raises(InvalidArgument, match="shows audio 1; the request has 1"):
            client.speak(turns, audio=[clip()], speak=False, options=CAPS)
        with pytest.raises(InvalidArgument, match="exactly once"):
            client.speak([{"role": "user", "content": "hi"}], audio=[clip()], speak=False, options=CAPS)
        both = stage_pb2.GenerationParams(
            prompt="a", messages=[chat_message({"role": "user", "content": "b"})]
        )
        with pytest.raises(InvalidArgument, match="not both"):
            list(client.stream(cpb.GenerateRequest(params=both)))


def prefix_hits(cluster: InProcessCluster) -> float:
    """The thinker's prefix cache hits, from the ar-encoder's metrics."""
    port = cluster.stage_options["ar-encoder"]["metrics_port"]
    assert isinstance(port, int)
    labels = frozenset({("stage", "ar-encoder"), ("role", "thinker")})
    return scrape(port).get(("omnistage_prefix_cache_hits", labels), 0.0)


USER_TURNS: list[object] = [
    [{"type": "audio", "audio": 0}, {"type": "text", "text": "Hello, who are you?"}],
    "Tell me a short story.",
    "Count from one to ten.",
]


def converse(cluster: InProcessCluster, audio: bytes) -> Iterator[tuple[list[dict[str, object]], Reply]]:
    """Three turns, each re-sending the whole history (a system prompt, an audio clip in the
    first user turn, the replies as assistant turns): per turn, the messages sent and the reply."""
    history: list[dict[str, object]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for content in USER_TURNS:
        history.append({"role": "user", "content": content})
        with Client(cluster.coordinator) as client:
            reply = client.speak(history, audio=[audio], seed=9, stream_audio=False, options=CAPS)
        yield list(history), reply
        history.append({"role": "assistant", "content": reply.text})


def test_a_conversation_equals_generate_on_its_full_history_and_reuses_its_prefix(
    omni: InProcessCluster, omni_model: Path
) -> None:
    audio = clip(seed=7)
    hits = prefix_hits(omni)
    for turn, (history, reply) in enumerate(converse(omni, audio)):
        ref = reference_generate(
            omni_model,
            messages=history,
            audios=[audio],
            seed=9,
            thinker_max_new_tokens=12,
            talker_max_new_tokens=40,
        )
        assert reply.text == ref.text, f"turn {turn + 1}"
        # Bitwise here (fp32, CPU): the suffix prefill after a reused prefix rounds as the whole one.
        np.testing.assert_array_equal(reply.audio, ref.waveform.numpy(), err_msg=f"turn {turn + 1}")
        assert prefix_hits(omni) == hits + turn, f"turn {turn + 1}: prefix hits"


def test_a_conversation_without_the_prefix_cache_gives_the_same_replies(
    omni: InProcessCluster, omni_model: Path
) -> None:
    audio = clip(seed=8)
    port = free_port()
    uncached = InProcessCluster(
        omni_model, stage_options={"ar-encoder": {"cache_bytes": 0, "metrics_port": port}}
    )
    uncached.start()
    try:
        without = [reply for _, reply in converse(uncached, audio)]
        assert prefix_hits(uncached) == 0
    finally:
        uncached.stop()
    hits = prefix_hits(omni)
    with_cache = [reply for _, reply in converse(omni, audio)]
    assert prefix_hits(omni) == hits + 2
    assert [r.text for r in with_cache] == [r.text for r in without]
    for cached, plain in zip(with_cache, without, strict=True):
        np.testing.assert_array_equal(cached.audio, plain.audio)


@pytest.fixture(scope="module")
def gateway(omni: InProcessCluster) -> Iterator[InProcessGateway]:
    running = InProcessGateway(omni.loop, omni.coordinator)
    yield running
    running.stop()


def openai_client(gateway: InProcessGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


def served_model(omni: InProcessCluster) -> str:
    with Client(omni.coordinator) as client:
        (model,) = client.list_models()
    return model.name


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_the_gateway_chat_takes_input_audio_and_image_url_data_urls(
    omni: InProcessCluster, gateway: InProcessGateway
) -> None:
    audio, image = clip(seed=4), picture(seed=4)
    content: list[Any] = [
        {"type": "input_audio", "input_audio": {"data": b64(audio), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}},
        {"type": "text", "text": PROMPT},
    ]
    completion = openai_client(gateway).chat.completions.create(
        model=served_model(omni),
        messages=[{"role": "user", "content": content}],
        modalities=["text"],
        seed=5,
        extra_body={"options": CAPS},
    )
    with Client(omni.coordinator) as client:
        reply = client.speak(PROMPT, audio=[audio], images=[image], seed=5, speak=False, options=CAPS)
    assert completion.choices[0].message.content == reply.text


def test_an_mp3_input_audio_is_heard_as_the_sdk_hears_it(
    omni: InProcessCluster, gateway: InProcessGateway
) -> None:
    samples, rate = soundfile.read(io.BytesIO(clip(seed=7)), dtype="int16")
    encoded = io.BytesIO()
    soundfile.write(encoded, samples, rate, format="MP3")
    mp3 = encoded.getvalue()
    content: list[Any] = [
        {"type": "input_audio", "input_audio": {"data": b64(mp3), "format": "mp3"}},
        {"type": "text", "text": PROMPT},
    ]
    completion = openai_client(gateway).chat.completions.create(
        model=served_model(omni),
        messages=[{"role": "user", "content": content}],
        modalities=["text"],
        seed=5,
        extra_body={"options": CAPS},
    )
    with Client(omni.coordinator) as client:
        reply = client.speak(PROMPT, audio=[mp3], seed=5, speak=False, options=CAPS)
    assert completion.choices[0].message.content == reply.text


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "never fetches URLs"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(picture()[:40])}},
            "not a readable image",
        ),
        ({"type": "input_audio", "input_audio": {"data": b64(b"not audio"), "format": "wav"}}, "not a WAV"),
        ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "not valid base64"),
        ({"type": "input_audio", "input_audio": {"data": b64(clip()), "format": "ogg"}}, "wav, flac or mp3"),
        ({"type": "input_audio", "input_audio": {"data": b64(clip(rate=8000)), "format": "wav"}}, "16000 Hz"),
        ({"type": "input_audio", "input_audio": {"data": b64(clip(seconds=0)), "format": "wav"}}, "0 s"),
    ],
    ids=["http-url", "broken-image", "not-audio", "bad-base64", "ogg", "wrong-rate", "zero-seconds"],
)
def test_hostile_gateway_media_get_400_about_messages(
    omni: InProcessCluster, gateway: InProcessGateway, part: dict[str, Any], message: str
) -> None:
    content = [part, {"type": "text", "text": PROMPT}]
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(gateway).chat.completions.create(
            model=served_model(omni),
            messages=[{"role": "user", "content": content}],
            extra_body={"options": CAPS},
        )
    assert raised.value.status_code == 400 and message in raised.value.message
    body: Any = raised.value.body
    assert body.get("param") == "messages"
