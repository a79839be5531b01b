"""Qwen2.5-Omni in real processes: a reply equals transformers' one-shot
`generate(return_audio=True)` bit for bit (text and waveform, greedy and sampled), and replies
whose talker or token2wav replica is killed with SIGKILL mid-reply finish on the other replica
with the text and audio of an uninterrupted run (seeded stages make the same chunks again; the
coordinator feeds the new replica the stream from its start and drops repeated chunks)."""

from __future__ import annotations

import io
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_common.audio_input import wav_bytes
from omni_common.chat import ReplyBuilder, chat_request
from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.errors import OmniError
from omni_common.models.qwen_omni.reference import reference_generate
from tests.conftest import assert_no_segment_added, omnistage_segments

pytestmark = pytest.mark.slow

PROMPT = "Tell me a short story."
ONE_THREAD = {"OMNISTAGE_THREADS": "1"}  # CPU float32 kernels round by thread count: equals on both sides


@pytest.fixture(scope="module")
def omni_cluster(omni_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    plan = loopback_plan(omni_model, "float32", ONE_THREAD)
    with LocalCluster(plan, log_dir=tmp_path_factory.mktemp("omni-logs")) as cluster:
        yield cluster.coordinator


@pytest.mark.parametrize("sampled", [False, True])
def test_a_reply_equals_generate_bitwise(omni_cluster: str, omni_model: Path, sampled: bool) -> None:
    options = {"max_new_tokens": 16, "talker_max_new_tokens": 60, "thinker_do_sample": int(sampled)}
    with Client(omni_cluster) as client:
        reply = client.speak(PROMPT, seed=11, stream_audio=False, options=options)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = reference_generate(
            omni_model,
            PROMPT,
            seed=11,
            thinker_do_sample=sampled,
            thinker_max_new_tokens=16,
            talker_max_new_tokens=60,
        )
    finally:
        torch.set_num_threads(threads)
    assert reply.text == ref.text
    np.testing.assert_array_equal(reply.audio, ref.waveform.numpy())


def clip_and_picture() -> tuple[bytes, bytes]:
    """One second of a 16 kHz noisy tone (16-bit WAV) and a 84x56 random PNG."""
    rng = np.random.default_rng(0)
    t = np.arange(16_000) / 16_000
    tone = np.clip(0.5 * np.sin(2 * np.pi * 440 * t) + rng.normal(0, 0.1, t.shape), -1, 1)
    pixels = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return wav_bytes(np.round(tone * 32767).astype(np.int16), 16_000), buffer.getvalue()


@pytest.mark.parametrize("media", ["audio", "image"])
def test_a_reply_to_text_and_media_equals_the_processor_and_generate_bitwise(
    omni_cluster: str, omni_model: Path, media: str
) -> None:
    clip, picture = clip_and_picture()
    audios, images = ([clip], []) if media == "audio" else ([], [picture])
    options = {"max_new_tokens": 16, "talker_max_new_tokens": 60}
    with Client(omni_cluster) as client:
        reply = client.speak(
            PROMPT, audio=audios, images=images, seed=11, stream_audio=False, options=options
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = reference_generate(
            omni_model,
            PROMPT,
            audios=audios,
            images=images,
            seed=11,
            thinker_max_new_tokens=16,
            talker_max_new_tokens=60,
        )
    finally:
        torch.set_num_threads(threads)
    assert reply.text == ref.text
    np.testing.assert_array_equal(reply.audio, ref.waveform.numpy())


LONG = {"max_new_tokens": 48, "talker_max_new_tokens": 600}  # 12 s of speech: long enough to kill


def speak_all(
    address: str, seeds: list[int], results: dict[int, object], step: str, started: threading.Semaphore
) -> list[threading.Thread]:
    """A thread per seed, each putting its Reply (or error) in `results`; `started` is released
    once per request when its `step` starts."""

    def one(seed: int) -> None:
        with Client(address) as client:
            builder = ReplyBuilder(0.0)
            try:
                for event in client.stream(chat_request(PROMPT, seed=seed, options=LONG)):
                    if event.HasField("stage_started") and event.stage_started.step == step:
                        started.release()
                    builder.add(event, 0.0)
                results[seed] = builder.build()
            except OmniError as err:
                results[seed] = err

    threads = [threading.Thread(target=one, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize(("stage", "step"), [("ar-encoder", "talker"), ("dit-denoise", "token2wav")])
def test_replies_on_a_killed_replica_finish_elsewhere(
    omni_model: Path, tmp_path: Path, stage: str, step: str
) -> None:
    before = omnistage_segments()
    seeds = [1, 2, 3, 4]
    plan = loopback_plan(omni_model, "float32", ONE_THREAD, replicas={stage: 2})
    with LocalCluster(plan, log_dir=tmp_path) as cluster:
        expected: dict[int, object] = {}
        for thread in speak_all(cluster.coordinator, seeds, expected, step, threading.Semaphore(0)):
            thread.join(300)
        results: dict[int, object] = {}
        started = threading.Semaphore(0)
        threads = speak_all(cluster.coordinator, seeds, results, step, started)
        for _ in seeds:
            assert started.acquire(timeout=120)
        assert not results, "the replies finished before the kill: make them longer"
        cluster.processes[stage].send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join(300)
        log = (tmp_path / "coordinator.log").read_text()
    for seed in seeds:
        got, want = results[seed], expected[seed]
        assert not isinstance(got, OmniError), (seed, got)
        assert got.text == want.text
        # Batches differ between an uninterrupted and a resumed run: float rounding, as for images.
        np.testing.assert_allclose(got.audio, want.audio, rtol=0, atol=1e-4)
    assert "moving on" in log, "no reply failed over"
    assert_no_segment_added(before)
