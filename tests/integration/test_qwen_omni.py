"""Qwen2.5-Omni through real gRPC servers and real shared memory: the coordinator streams the
thinker's rows into the talker, the talker's codes into token2wav, the mel into the vocoder,
and the audio to the client while the reply is still being written; the one-shot reply equals
transformers' `generate(return_audio=True)` bit for bit; concurrent replies equal their lone
ones; a cancelled reply frees everything; hostile feeds are refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from omni_common.chat import SpeechChunk, TextDelta, chat_request
from omni_common.client import Client
from omni_common.cluster import free_port
from omni_common.errors import Cancelled, InvalidArgument
from omni_common.models.qwen_omni.reference import reference_generate
from omni_common.net.rpc import sync_channel
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage_cli import main as cli
from tests.integration.conftest import InProcessCluster

PROMPT = "Tell me a short story."
CAPS = {"max_new_tokens": 16, "talker_max_new_tokens": 60}


@pytest.fixture(scope="module")
def omni(omni_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(omni_model, stage_options={"ar-encoder": {"metrics_port": free_port()}})
    running.start()
    yield running
    running.stop()


def events(cluster: InProcessCluster, seed: int = 3, **kwargs: object) -> list[cpb.GenerateEvent]:
    options = {**CAPS, **kwargs.pop("options", {})}  # type: ignore[dict-item]
    with Client(cluster.coordinator) as client:
        return list(client.stream(chat_request(PROMPT, seed=seed, options=options, **kwargs), 120))  # type: ignore[arg-type]


def leases_and_jobs_free(cluster: InProcessCluster) -> bool:
    return not any(cluster.live_leases().values())


def wait_until(check, timeout: float = 10.0) -> bool:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_list_models_describes_a_speaking_model(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client:
        (model,) = client.list_models()
    assert model.family == "qwen2.5-omni" and model.ready
    assert list(model.outputs) == ["text", "audio"]
    assert set(model.roles) == {"thinker", "talker", "token2wav", "vocoder"}
    speaker = next(option for option in model.options if option.name == "speaker")
    assert speaker.type == "str" and speaker.default_value == "Chelsie"


def test_a_one_shot_reply_equals_transformers_generate(omni: InProcessCluster, omni_model: Path) -> None:
    with Client(omni.coordinator) as client:
        reply = client.speak(PROMPT, seed=3, stream_audio=False, options=CAPS)
    ref = reference_generate(omni_model, PROMPT, seed=3, thinker_max_new_tokens=16, talker_max_new_tokens=60)
    assert reply.text == ref.text and reply.sample_rate == 24_000
    np.testing.assert_array_equal(reply.audio, ref.waveform.numpy())
    assert wait_until(lambda: leases_and_jobs_free(omni))


def test_each_step_streams_into_the_next_and_audio_comes_before_the_end(omni: InProcessCluster) -> None:
    long = {"max_new_tokens": 200, "talker_max_new_tokens": 200}  # the first audio needs 48 codes
    streamed = events(omni, stream_audio=True, options=long)

    def at(kind: str, step: str) -> int:
        return next(i for i, e in enumerate(streamed) if getattr(e, kind).step == step and e.HasField(kind))

    first_audio = next(i for i, e in enumerate(streamed) if e.HasField("audio"))
    assert at("stage_started", "talker") < at("stage_finished", "thinker")
    assert at("stage_started", "token2wav") < at("stage_finished", "talker")
    assert at("stage_started", "vocoder") < first_audio < at("stage_finished", "token2wav")
    assert sum(e.HasField("audio") for e in streamed) >= 4 and streamed[-1].HasField("result")
    with Client(omni.coordinator) as client:
        one_shot = client.speak(PROMPT, seed=3, stream_audio=False, options={**CAPS, **long})
    audio = np.concatenate([np.frombuffer(e.audio.data, "<f4") for e in streamed if e.HasField("audio")])
    assert streamed[-1].result.audio_samples == len(audio) == len(one_shot.audio)
    assert float(np.abs(audio - one_shot.audio).max()) < 1e-5  # windowed flow matching (docs/families.md)
    assert streamed[-1].result.text == one_shot.text


def talker_feeds(cluster: InProcessCluster) -> float:
    key = ("omnistage_stage_feeds_total", frozenset({"stage": "ar-encoder", "role": "talker"}.items()))
    return cluster.metrics("ar-encoder").get(key, 0.0)


def test_rows_in_groups_give_the_same_reply_in_fewer_feeds(omni: InProcessCluster) -> None:
    """The talker is fed the thinker's first row alone (with the Run call), then a chunk per
    `feed_tokens` tokens, then the end; text-only chunks are not fed. n tokens make n - 1 rows
    (the last token is never fed back): n - 2 Feeds + the end with a Feed per token, against
    ceil((n - 2) / 4) + the end in groups of 4. The reply is the same, bit for bit."""
    replies, feeds = {}, {}
    for k in (1, 4):
        before = talker_feeds(omni)
        replies[k] = events(omni, options={"feed_tokens": k})
        feeds[k] = talker_feeds(omni) - before
    text = ["".join(e.text.text for e in replies[k] if e.HasField("text")) for k in (1, 4)]
    audio = [b"".join(e.audio.data for e in replies[k] if e.HasField("audio")) for k in (1, 4)]
    assert text[0] == text[1] and audio[0] == audio[1] and audio[0]
    tokens = max(e.tokens.tokens for e in replies[1] if e.HasField("tokens") and e.tokens.step == "thinker")
    assert feeds == {1: tokens - 2 + 1, 4: -(-(tokens - 2) // 4) + 1}, tokens


def test_pcm16_chunks_are_the_float_samples_rounded(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client:
        exact = client.speak(PROMPT, seed=5, options=CAPS)
        pieces = list(client.chat(PROMPT, seed=5, options=CAPS, audio_format="pcm16"))
    audio = np.concatenate([p.samples for p in pieces if isinstance(p, SpeechChunk)])
    text = "".join(p.text for p in pieces if isinstance(p, TextDelta))
    assert text == exact.text
    assert float(np.abs(audio - exact.audio).max()) <= 0.5 / 32767 + 1e-7


def test_a_text_only_reply_has_no_audio(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client:
        spoken = client.speak(PROMPT, seed=3, options=CAPS)
        written = client.speak(PROMPT, seed=3, audio=False, options=CAPS)
    assert written.text == spoken.text and len(written.audio) == 0


def test_eight_replies_at_once_each_equal_their_lone_reply(omni: InProcessCluster) -> None:
    seeds = list(range(8))
    with Client(omni.coordinator) as client:
        alone = {seed: client.speak(PROMPT, seed=seed, options=CAPS) for seed in seeds}

        def speak(seed: int):
            return client.speak(PROMPT, seed=seed, options=CAPS)

        with ThreadPoolExecutor(8) as pool:
            together = dict(zip(seeds, pool.map(speak, seeds), strict=True))
    for seed in seeds:
        assert together[seed].text == alone[seed].text
        # float32 rounding follows the batch: a waveform moves by up to ~1e-5 (CI saw 1.02e-5).
        np.testing.assert_allclose(together[seed].audio, alone[seed].audio, rtol=0, atol=1e-4)
    assert wait_until(lambda: leases_and_jobs_free(omni))


@pytest.mark.parametrize("step", ["thinker", "talker", "token2wav"])
def test_a_reply_cancelled_in_any_step_frees_everything(omni: InProcessCluster, step: str) -> None:
    request_id = f"cancel-{step}"
    started = threading.Event()
    failure: list[BaseException] = []

    def listen() -> None:
        try:
            with Client(omni.coordinator) as client:
                request = chat_request(PROMPT, seed=1, options={**CAPS, "talker_max_new_tokens": 400})
                request.request_id = request_id
                for event in client.stream(request, 120):
                    if event.HasField("stage_started") and event.stage_started.step == step:
                        started.set()
        except Cancelled as err:
            failure.append(err)

    listener = threading.Thread(target=listen)
    listener.start()
    assert started.wait(60)
    with Client(omni.coordinator) as client:
        assert client.cancel(request_id)
    listener.join(60)
    assert failure and isinstance(failure[0], Cancelled)
    assert wait_until(lambda: leases_and_jobs_free(omni))


def test_an_unknown_speaker_is_invalid(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client, pytest.raises(InvalidArgument, match="unknown speaker"):
        client.speak(PROMPT, speaker="Nobody", options=CAPS)


def test_feeds_for_no_running_call_are_refused(omni: InProcessCluster) -> None:
    stub = stage_pb2_grpc.StageStub(sync_channel(omni.addresses["ar-encoder"]))
    forged = stage_pb2.FeedRequest(request_id="nobody", role="talker", index=1, end=True)
    with pytest.raises(grpc.RpcError) as err:
        stub.Feed(forged, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.Feed(stage_pb2.FeedRequest(request_id="bad id!", role="talker", index=1), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(omni.coordinator) as client:  # still serving
        assert client.speak(PROMPT, seed=3, options=CAPS).text


def test_the_speak_command_prints_the_reply_and_saves_its_audio(
    omni: InProcessCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reply.wav"
    caps = [f"--option={name}={value}" for name, value in CAPS.items()]
    argv = ["speak", PROMPT, "-o", str(out), "--address", omni.coordinator, "--seed", "3", *caps]
    assert cli.main([*argv, "--quiet"]) == 0
    printed = capsys.readouterr().out
    with Client(omni.coordinator) as client:
        reply = client.speak(PROMPT, seed=3, options=CAPS)
    assert reply.text and printed.startswith(reply.text + "\n")
    assert f"saved {out.resolve()} ({reply.seconds:.2f} s of speech" in printed
    expected = tmp_path / "expected.wav"
    reply.save(expected)
    assert out.read_bytes() == expected.read_bytes()


def test_a_text_only_reply_prints_its_text_and_writes_no_wav(
    omni: InProcessCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "none.wav"
    caps = [f"--option={name}={value}" for name, value in CAPS.items()]
    argv = ["speak", PROMPT, "-o", str(out), "--address", omni.coordinator, "--seed", "3", *caps]
    assert cli.main([*argv, "--option", "audio=0", "--quiet"]) == 0
    printed = capsys.readouterr().out
    with Client(omni.coordinator) as client:
        reply = client.speak(PROMPT, seed=3, audio=False, options=CAPS)
    assert not reply.spoken and reply.text and printed.startswith(reply.text + "\n")
    assert "not written" in printed and not out.exists()
    with pytest.raises(ValueError, match="no audio"):
        reply.save(out)
    assert not out.exists()
