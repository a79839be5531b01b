"""Qwen2.5-Omni in real processes: a reply equals transformers' one-shot
`generate(return_audio=True)` bit for bit (text and waveform, greedy and sampled), and replies
whose thinker, talker or token2wav replica is killed with SIGKILL mid-reply finish on the other
replica with the text and audio of an uninterrupted run: a thinker starts again from the seed
and makes the same chunks (the coordinator drops those it holds), the talker and token2wav
resume from their checkpoints, and the coordinator feeds the new replica the stream from its
start, from its own copies of the chunks."""

from __future__ import annotations

import io
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_common.audio_input import wav_bytes
from omni_common.chat import Reply, ReplyBuilder, chat_request
from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan, stage_process
from omni_common.errors import OmniError
from omni_common.media import Video
from omni_common.models.qwen_omni.reference import reference_generate
from omnistage.v1 import coordinator_pb2 as cpb
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


def mirrored(picture: bytes) -> bytes:
    """The PNG `picture` flipped left to right: a second frame unlike the first."""
    buffer = io.BytesIO()
    Image.open(io.BytesIO(picture)).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("media", ["audio", "image", "video"])
def test_a_reply_to_text_and_media_equals_the_processor_and_generate_bitwise(
    omni_cluster: str, omni_model: Path, media: str
) -> None:
    clip, picture = clip_and_picture()
    audios = [clip] if media == "audio" else []
    images = [picture] if media == "image" else []
    videos = [([picture, mirrored(picture), picture], 2.0)] if media == "video" else []
    options = {"max_new_tokens": 16, "talker_max_new_tokens": 60}
    with Client(omni_cluster) as client:
        reply = client.speak(
            PROMPT,
            audio=audios,
            images=images,
            video=[Video(f, fps) for f, fps in videos],
            seed=11,
            stream_audio=False,
            options=options,
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = reference_generate(
            omni_model,
            PROMPT,
            audios=audios,
            images=images,
            videos=videos,
            seed=11,
            thinker_max_new_tokens=16,
            talker_max_new_tokens=60,
        )
    finally:
        torch.set_num_threads(threads)
    assert reply.text == ref.text
    np.testing.assert_array_equal(reply.audio, ref.waveform.numpy())


# Long enough to kill each step mid-reply (the thinker writes 120 tokens, the talker says 240
# codes = 4.8 s): the test waits for progress events, never for time.
LONG = {"max_new_tokens": 120, "talker_max_new_tokens": 240}
SEEDS = (1, 2)
# Below one row of the tiny thinker (32 x 4 bytes): every streamed chunk and checkpoint lives in
# its producer's shared memory, as a real-size row (7 KB in bf16) does above the default 64 KiB.
TINY_INLINE = {**ONE_THREAD, "OMNISTAGE_INLINE_BYTES": "64"}
# One reply a forward, in every process: float32 rounds by batch (two replies batched against
# each alone differed by up to 9e-8 in the audio), and which replies share a forward depends on
# when each arrives, which a failover changes. Unbatched, a resumed reply's audio is the
# uninterrupted one's bit for bit (the vocoder's windows follow the chunks, not their pace).
ONE_ROW = {"OMNISTAGE_MAX_BATCH": "1"}
# Each role's replicas, two of each role that a test kills, each a pod of its own (host id and
# /dev/shm): a killed replica's shared memory goes with it.
PODS = {
    "thinker": ("ar-encoder", "thinker"),
    "talker": ("ar-encoder", "talker"),
    "token2wav": ("dit-denoise", ""),
}


@dataclass
class FailoverCluster:
    cluster: LocalCluster
    pods: dict[str, Path]  # replica name -> its shared-memory directory
    expected: dict[int, Reply | OmniError]  # seed -> the uninterrupted reply


@pytest.fixture(scope="module")
def failover(omni_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverCluster]:
    root = tmp_path_factory.mktemp("omni-failover")
    plan = [
        p
        for p in loopback_plan(omni_model, "float32", {**TINY_INLINE, **ONE_ROW})
        if p.name not in ("ar-encoder", "dit-denoise")
    ]
    coordinator, pods = plan[0].health_address, {}
    for name, (stage, roles) in PODS.items():
        for replica in (name, f"{name}-2"):
            pods[replica] = root / replica
            pods[replica].mkdir()
            env = {**TINY_INLINE, **ONE_ROW, "OMNISTAGE_DTYPE": "float32", "OMNISTAGE_HOST_ID": replica}
            env |= {"OMNISTAGE_SHM_DIR": str(pods[replica]), "OMNISTAGE_ROLES": roles}
            plan.append(stage_process(stage, omni_model, coordinator, replica, env))
    with LocalCluster(plan, log_dir=root / "logs") as cluster:
        expected: dict[int, Reply | OmniError] = {}
        for thread in speak_all(cluster.coordinator, expected, lambda _: False, lambda _: None):
            thread.join(300)
        yield FailoverCluster(cluster, pods, expected)


def speak_all(
    address: str,
    results: dict[int, Reply | OmniError],
    due: Callable[[cpb.GenerateEvent], bool],
    at_due: Callable[[int], None],
    where: dict[int, dict[str, str]] | None = None,
) -> list[threading.Thread]:
    """A thread per seed, each putting its Reply (or error) in `results`; `at_due(seed)` runs in
    the request's thread at its first event for which `due` holds, before it reads another;
    `where[seed]` says, by step, the replica that runs it (its StageStarted events)."""

    def one(seed: int) -> None:
        with Client(address) as client:
            builder, released = ReplyBuilder(0.0), False
            try:
                for event in client.stream(chat_request(PROMPT, seed=seed, options=LONG)):
                    if where is not None and event.HasField("stage_started"):
                        where.setdefault(seed, {})[event.stage_started.step] = event.stage_started.replica
                    if not released and due(event):
                        released = True
                        at_due(seed)
                    builder.add(event, 0.0)
                results[seed] = builder.build()
            except OmniError as err:
                results[seed] = err

    threads = [threading.Thread(target=one, args=(seed,)) for seed in SEEDS]
    for thread in threads:
        thread.start()
    return threads


def tokens_past(step: str, count: int) -> Callable[[cpb.GenerateEvent], bool]:
    return lambda e: e.HasField("tokens") and e.tokens.step == step and e.tokens.tokens >= count


# When to kill: the thinker past 16 tokens of its 120; the talker past 16 codes (the coordinator
# holds its checkpoint of code 15: checkpoints come every 5 steps, before their progress event);
# token2wav once audio arrived (its checkpoint of the first window went with that window's mel).
KILL_WHEN = {
    "thinker": tokens_past("thinker", 16),
    "talker": tokens_past("talker", 16),
    "token2wav": lambda e: e.HasField("audio"),
}


@pytest.mark.parametrize("victim", ["thinker", "talker", "token2wav"])
def test_a_reply_whose_replica_is_killed_finishes_elsewhere_as_if_uninterrupted(
    failover: FailoverCluster, victim: str
) -> None:
    """SIGKILL of one of two replicas of the thinker, the talker or token2wav mid-reply, its pod's
    shared memory removed: every reply finishes on the other replica with the uninterrupted text
    and audio, the thinker's streamed rows read from the coordinator's copies, the talker and
    token2wav resumed from their checkpoints, not from the start."""
    cluster, before = failover.cluster, omnistage_segments()
    results: dict[int, Reply | OmniError] = {}
    where: dict[int, dict[str, str]] = {}
    frozen: list[str] = []  # the address and name of the replica stopped mid-step
    stopped = threading.Event()

    def freeze(seed: int) -> None:
        """The first reply's step is past its kill point: stop its replica there (SIGSTOP, from
        the reply's own thread before it reads on), so the step is still in flight when killed,
        however fast the machine."""
        if seed != SEEDS[0]:
            return
        address = where[seed][victim]
        name = next(proc.name for proc in cluster.plan if proc.health_address == address)
        cluster.processes[name].send_signal(signal.SIGSTOP)
        frozen.extend((address, name))
        stopped.set()

    threads = speak_all(cluster.coordinator, results, KILL_WHEN[victim], freeze, where)
    assert stopped.wait(120), "the first reply never reached its kill point"
    address, name = frozen
    cluster.processes[name].send_signal(signal.SIGKILL)
    cluster.processes[name].wait(30)
    shutil.rmtree(failover.pods[name])
    for thread in threads:
        thread.join(300)
    assert cluster.log_dir is not None
    log = (cluster.log_dir / "coordinator.log").read_text()
    for seed in SEEDS:
        got, want = results[seed], failover.expected[seed]
        assert not isinstance(got, OmniError) and not isinstance(want, OmniError), (seed, got, want)
        assert got.text == want.text
        # A resumed step recomputes what the dead replica had (a prefill of the codes so far, the
        # window's solver from its checkpoint), one reply a forward (ONE_ROW): bit for bit.
        np.testing.assert_array_equal(got.audio, want.audio)
    moved = [line for line in log.splitlines() if f"replica {address} " in line and "moving on" in line]
    assert moved, "no reply failed over"
    if victim != "thinker":
        assert f"{victim} resumes on" in log and "checkpoint gone" not in log
    assert_no_segment_added(before)
