"""GLM-Image through real gRPC servers and real shared memory: the coordinator runs the
family's plan (AR prior and glyph at once; in edit mode VAE encode and the condition KV), the
images equal diffusers' GlmImagePipeline in one process bit for bit, the condition KV is
reused by later requests with the same image, and hostile requests are refused."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from omni_common.client import Client, GenerationResult
from omni_common.cluster import free_port
from omni_common.errors import Cancelled, DeadlineExceeded, InvalidArgument, OmniError
from omni_common.models.glm_image.reference import load_pipeline
from omnistage.v1 import coordinator_pb2 as cpb
from tests.glm import pipeline_image, png
from tests.integration.conftest import InProcessCluster, scrape

STEPS = 3
EDIT_PROMPT = "make it red, add a sign saying 'hat'"


@pytest.fixture(scope="module")
def glm(glm_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(glm_model, coordinator_options={"metrics_port": free_port()})
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def pipe(glm_model: Path):
    return load_pipeline(glm_model)


def generate(
    cluster: InProcessCluster, prompt: str, seed: int, images: Sequence[bytes] = (), **kw: object
) -> GenerationResult:
    with Client(cluster.coordinator) as client:
        return client.generate_result(
            prompt, images=images, width=64, height=64, steps=STEPS, seed=seed, return_tensor=True, **kw
        )


def expected(pipe, prompt: str, seed: int, images: Sequence[bytes] = ()) -> np.ndarray:
    return pipeline_image(pipe, prompt, seed, STEPS, images).numpy()


def steps_of(events: list[cpb.GenerateEvent]) -> tuple[list[str], list[str]]:
    order = [
        ("started", e.stage_started.step)
        if e.HasField("stage_started")
        else ("finished", e.stage_finished.step)
        for e in events
        if e.HasField("stage_started") or e.HasField("stage_finished")
    ]
    first_finish = next(i for i, (kind, _) in enumerate(order) if kind == "finished")
    return [step for _, step in order[:first_finish]], [step for kind, step in order if kind == "finished"]


def test_list_models_describes_glm_image(glm: InProcessCluster) -> None:
    with Client(glm.coordinator) as client:
        (model,) = client.list_models()
    assert model.family == "glm-image" and model.ready
    assert list(model.inputs) == ["text", "image"] and model.max_images == 4
    assert model.size_multiple == 32 and model.defaults["true_cfg_scale"] == 1.5
    assert set(model.roles) == {
        "prior",
        "glyph",
        "denoise",
        "condition-kv",
        "vae-decode",
        "vae-encode",
    }


def test_text_to_image_equals_the_pipeline_bitwise_with_prior_and_glyph_at_once(glm, pipe) -> None:
    with Client(glm.coordinator) as client:
        events = list(
            client.events(
                "a sign that says 'open'", width=64, height=64, steps=STEPS, seed=1, return_tensor=True
            )
        )
    started_first, finished = steps_of(events)
    assert set(started_first) == {"prior", "glyph"}  # both began before either ended
    assert sorted(finished) == ["decode", "denoise", "glyph", "prior"]
    tokens = [e.tokens.tokens for e in events if e.HasField("tokens")]
    assert tokens == sorted(tokens) and tokens[-1] > 200  # a 16x16 preview, then the 4x4 target
    with Client(glm.coordinator) as client:
        result = client.generate_result(
            "a sign that says 'open'", width=64, height=64, steps=STEPS, seed=1, return_tensor=True
        )
    assert result.tensor is not None
    assert np.array_equal(result.tensor, expected(pipe, "a sign that says 'open'", 1))
    wait_until_only_the_cache_holds_leases(glm)


def wait_until_only_the_cache_holds_leases(cluster: InProcessCluster, timeout_s: float = 10.0) -> None:
    """Every lease but those of cached condition KV (keys and values per entry) is released."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(cluster.coordinator_options["metrics_port"])  # type: ignore[arg-type]
        cached = 2 * int(samples[("omnistage_coordinator_step_cache_entries", frozenset())])
        expected = dict.fromkeys(cluster.live_leases(), 0) | {"dit-denoise": cached}
        if cluster.live_leases() == expected or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert cluster.live_leases() == expected


def condition_kv_hits(cluster: InProcessCluster) -> float:
    samples = scrape(cluster.coordinator_options["metrics_port"])  # type: ignore[arg-type]
    return samples.get(
        ("omnistage_coordinator_step_cache_hits_total", frozenset({("step", "condition-kv")})), 0.0
    )


def test_edit_equals_the_pipeline_bitwise_and_reuses_the_condition_kv(glm, pipe) -> None:
    image = png(3)
    hits = condition_kv_hits(glm)
    with Client(glm.coordinator) as client:
        first = list(client.events(EDIT_PROMPT, images=[image], width=64, height=64, steps=STEPS, seed=11))
    started_first, _ = steps_of(first)
    assert {"prior", "glyph", "vae-encode"} <= set(started_first)
    kv = [
        e.stage_finished
        for e in first
        if e.HasField("stage_finished") and e.stage_finished.step == "condition-kv"
    ]
    assert len(kv) == 1 and not kv[0].cached

    with Client(glm.coordinator) as client:
        again = list(
            client.events(
                "add a sign saying 'cat'", images=[image], width=64, height=64, steps=STEPS, seed=12
            )
        )
    ran = [e.stage_started.step for e in again if e.HasField("stage_started")]
    assert "condition-kv" not in ran and "vae-encode" not in ran  # the KV came from the cache
    kv = [
        e.stage_finished
        for e in again
        if e.HasField("stage_finished") and e.stage_finished.step == "condition-kv"
    ]
    assert len(kv) == 1 and kv[0].cached

    cold = generate(glm, EDIT_PROMPT, 11, [image])
    warm = generate(glm, "add a sign saying 'cat'", 12, [image])
    assert condition_kv_hits(glm) == hits + 3  # the first request wrote it, every later one read it
    assert np.array_equal(cold.tensor, expected(pipe, EDIT_PROMPT, 11, [image]))
    assert np.array_equal(warm.tensor, expected(pipe, "add a sign saying 'cat'", 12, [image]))
    wait_until_only_the_cache_holds_leases(glm)


def test_concurrent_requests_each_get_their_own_image(glm, pipe) -> None:
    """Eight requests at once: the prior and the denoiser batch them. Batched float32 products
    round differently from lone ones, so images are compared within rounding; a token sampled
    from a neighbour's row would change an image far more."""
    work = [(f"edit {i}: add a 'hat'", 20 + i, [png(40 + i)]) for i in range(6)]
    work += [(f"a sign that says '{i}'", 30 + i, []) for i in range(2)]
    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(lambda w: generate(glm, *w), work))
    for (prompt, seed, images), result in zip(work, results, strict=True):
        np.testing.assert_allclose(result.tensor, expected(pipe, prompt, seed, images), atol=1e-4)
    wait_until_only_the_cache_holds_leases(glm)


def test_cancel_between_tokens_stops_the_prior_and_frees_everything(glm: InProcessCluster) -> None:
    outcome: list[BaseException] = []
    tokens_seen: list[int] = []

    def run() -> None:
        with Client(glm.coordinator) as client:
            try:
                for event in client.events("slow", request_id="cancel-glm", width=256, height=256, steps=2):
                    if event.HasField("tokens"):
                        tokens_seen.append(event.tokens.tokens)
            except OmniError as err:
                outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not tokens_seen and time.monotonic() < deadline:
        time.sleep(0.005)
    with Client(glm.coordinator) as client:
        assert client.cancel("cancel-glm") is True
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled)
    assert tokens_seen and max(tokens_seen) < 64 * 4  # a 256x256 image samples 8x8 + 16x16 + 1
    wait_until_only_the_cache_holds_leases(glm)
    assert generate(glm, EDIT_PROMPT, 5, [png(5)]).tensor is not None


def test_a_deadline_stops_the_prior_between_tokens(glm: InProcessCluster) -> None:
    """A 1024x1024 image samples over a thousand tokens (seconds here): a deadline after its
    first tokens ends it mid-way, and everything it held is freed."""
    tokens: list[int] = []
    total = 0
    with Client(glm.coordinator) as client, pytest.raises(DeadlineExceeded):
        for event in client.events("late", width=1024, height=1024, steps=2, timeout=0.6):
            if event.HasField("tokens"):
                tokens.append(event.tokens.tokens)
                total = event.tokens.total
    assert tokens and max(tokens) < total  # it was sampling when the deadline passed
    wait_until_only_the_cache_holds_leases(glm)
    assert generate(glm, EDIT_PROMPT, 6, [png(6)]).tensor is not None


def zero_size_png() -> bytes:
    """A PNG whose header says 0x0 (PIL writes none such: built by hand)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def truncated_png() -> bytes:
    data = png(9)
    return data[: len(data) // 2]


HOSTILE = {
    "not an image": ({"images": [b"hello, not a picture"]}, "image"),
    "empty image": ({"images": [b""]}, "image"),
    "0x0 image": ({"images": [zero_size_png()]}, "image"),
    "truncated image": ({"images": [truncated_png()]}, "image"),
    "too wide": ({"images": [png(1, width=4128, height=32)]}, "4096"),
    "side not a multiple of 32": ({"images": [png(1, width=48, height=64)]}, "multiples of 32"),
    "five images": ({"images": [png(i) for i in range(5)]}, "at most 4"),
    "negative prompt": ({"negative_prompt": "blurry"}, "negative prompt"),
    "unknown option": ({"options": {"strength": "0.5"}}, "strength"),
    "size not a multiple of 32": ({"width": 48}, "multiple of 32"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_requests_are_invalid_arguments_and_the_service_stays_up(glm, case: str) -> None:
    changes, message = HOSTILE[case]
    kwargs: dict[str, object] = {"width": 64, "height": 64, "steps": STEPS, **changes}
    with Client(glm.coordinator) as client, pytest.raises(InvalidArgument, match=message):
        client.generate("hostile", **kwargs)
    wait_until_only_the_cache_holds_leases(glm)
    with Client(glm.coordinator) as client:
        (model,) = client.list_models()
    assert model.ready
