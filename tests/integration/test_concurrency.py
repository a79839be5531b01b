"""Many requests at once through real servers: batching keeps results right, and cancels,
deadlines and full queues affect only their own request and leave no lease behind."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from omni_common.client import AsyncClient, Client
from omni_common.cluster import free_port
from omni_common.errors import Cancelled, DeadlineExceeded, OmniError, ResourceExhausted
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from tests.integration.conftest import InProcessCluster, scrape
from tests.integration.test_generate import wait_until_no_leases

SMALL = {"width": 64, "height": 64, "steps": 4}
# Batched and lone forwards differ by float rounding only (~1e-6 on the latents); after the
# VAE that stays far below one 8-bit level, so the raw float images agree to 1e-4.
IMAGE_TOL = 1e-4


@pytest.fixture(scope="module")
def busy_cluster(tiny_model: Path) -> Iterator[InProcessCluster]:
    """A cluster whose encoder waits 300 ms for company (so a request can be caught while
    encoding) and whose DiT steps one request at a time from a queue of at most 3."""
    running = InProcessCluster(
        tiny_model,
        stage_options={
            "ar-encoder": {"batch_window_ms": 300.0},
            "dit-denoise": {"max_batch": 1, "max_queue": 3},
        },
    )
    running.start()
    yield running
    running.stop()


def test_fifty_concurrent_requests_with_random_cancels(cluster: InProcessCluster) -> None:
    rng = random.Random(7)
    seeds = list(range(50))
    cancel = {s for s in seeds if rng.random() < 0.3}

    with Client(cluster.coordinator) as client:
        solo = {
            s: client.generate_result("a lamp", seed=s, return_tensor=True, **SMALL).tensor for s in (1, 2, 3)
        }

    async def one(client: AsyncClient, seed: int) -> object:
        request_id = f"many-{seed}"
        task = asyncio.create_task(
            client.generate_result("a lamp", seed=seed, request_id=request_id, return_tensor=True, **SMALL)
        )
        if seed in cancel:
            await asyncio.sleep(rng.random() * 0.3)
            await client.cancel(request_id)
        try:
            return await task
        except OmniError as err:
            return err

    async def main() -> list[object]:
        async with AsyncClient(cluster.coordinator) as client:
            return list(await asyncio.gather(*(one(client, s) for s in seeds)))

    results = asyncio.run(main())
    for seed, result in zip(seeds, results, strict=True):
        if isinstance(result, OmniError):
            assert seed in cancel and isinstance(result, Cancelled), (seed, result)
            continue
        assert result.image.size == (64, 64)  # type: ignore[attr-defined]
        if seed in solo:
            np.testing.assert_allclose(result.tensor, solo[seed], atol=IMAGE_TOL, rtol=0)  # type: ignore[attr-defined]
    completed = sum(not isinstance(r, OmniError) for r in results)
    assert completed >= len(seeds) - len(cancel)
    wait_until_no_leases(cluster)


def _cancel_when(cluster: InProcessCluster, request_id: str, seen: str, **options: object) -> list[str]:
    """Start a request, cancel it once the event `seen` arrives; returns the event kinds."""
    kinds: list[str] = []
    outcome: list[BaseException] = []

    def run() -> None:
        with Client(cluster.coordinator) as client:
            try:
                for event in client.events("cancel me", request_id=request_id, **{**SMALL, **options}):
                    kind = event.WhichOneof("event")
                    kinds.append(kind if kind != "stage_started" else f"started:{event.stage_started.stage}")
            except OmniError as err:
                outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while seen not in kinds and time.monotonic() < deadline:
        time.sleep(0.005)
    with Client(cluster.coordinator) as client:
        assert client.cancel(request_id)
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled), (kinds, outcome)
    assert "result" not in kinds
    return kinds


def test_cancel_while_encoding(busy_cluster: InProcessCluster) -> None:
    kinds = _cancel_when(busy_cluster, "cancel-encoding", "started:ar-encoder")
    assert "started:dit-denoise" not in kinds
    wait_until_no_leases(busy_cluster)


def test_cancel_while_denoising(busy_cluster: InProcessCluster) -> None:
    kinds = _cancel_when(busy_cluster, "cancel-denoising", "step", steps=300)
    assert "started:vae-decode" not in kinds
    wait_until_no_leases(busy_cluster)


def test_cancel_while_decoding(busy_cluster: InProcessCluster) -> None:
    kinds = _cancel_when(
        busy_cluster, "cancel-decoding", "started:vae-decode", width=512, height=512, steps=2
    )
    assert "step" in kinds
    wait_until_no_leases(busy_cluster)


def test_cancel_while_queued_behind_another_request(busy_cluster: InProcessCluster) -> None:
    blocker_outcome: list[Exception] = []

    def blocker() -> None:
        with Client(busy_cluster.coordinator) as client:
            try:  # the most steps a request may take: cancelled below, still running
                client.generate("blocker", request_id="blocker", **{**SMALL, "steps": 1000})
            except OmniError as err:
                blocker_outcome.append(err)

    thread = threading.Thread(target=blocker)
    thread.start()
    time.sleep(0.5)  # the blocker holds the DiT (max_batch 1); the next one queues behind it
    kinds = _cancel_when(busy_cluster, "cancel-queued", "started:dit-denoise")
    assert "step" not in kinds, "a queued request must not have run a step"
    with Client(busy_cluster.coordinator) as client:
        assert client.cancel("blocker")  # it held the DiT all along
    thread.join(60)
    assert len(blocker_outcome) == 1 and isinstance(blocker_outcome[0], Cancelled), blocker_outcome
    wait_until_no_leases(busy_cluster)


def test_full_dit_queue_is_resource_exhausted_with_retry_hint(busy_cluster: InProcessCluster) -> None:
    denoiser = busy_cluster.addresses["dit-denoise"]
    encoder_output = busy_cluster.transports["ar-encoder"]
    import torch

    embeds = encoder_output.export_state({"prompt_embeds": torch.zeros(1, 5, 16)}, {})
    params = stage_pb2.GenerationParams(
        model="qwen-image-tiny",
        prompt="q",
        width=64,
        height=64,
        num_inference_steps=1000,  # the most there is; 200 at ~1.5 ms a step ended mid-test
        true_cfg_scale=1.0,
        max_sequence_length=512,
    )

    async def main() -> tuple[list[object], grpc.aio.AioRpcError | None]:
        from omni_common.net.rpc import aio_channel

        async with aio_channel(denoiser) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            # The previous test's cancelled request may still be leaving the DiT's queue (it
            # goes at a step boundary): the fills start from an empty stage.
            for _ in range(500):
                if (await stub.Info(stage_pb2.StageInfoRequest())).load == 0:
                    break
                await asyncio.sleep(0.02)
            calls = [
                stub.Run(stage_pb2.StageRequest(request_id=f"fill-{i}", params=params, input=embeds))
                for i in range(3)
            ]
            firsts = [asyncio.create_task(c.read()) for c in calls]
            # The first fill steps (one at a time: the others wait their turn, held in the
            # queue), and the other two have arrived; none can finish its 1000 steps meanwhile.
            await asyncio.wait_for(asyncio.shield(firsts[0]), 10)
            await asyncio.sleep(0.1)
            refused = None
            try:
                extra = stub.Run(stage_pb2.StageRequest(request_id="extra", params=params, input=embeds))
                await extra.read()
            except grpc.aio.AioRpcError as err:
                refused = err
            for c in calls:
                c.cancel()
            return await asyncio.gather(*firsts, return_exceptions=True), refused

    _, refused = asyncio.run(main())
    encoder_output.release(encoder_output.lease_ids(embeds))
    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at capacity" in (refused.details() or "")
    hints = dict(refused.trailing_metadata() or ())
    assert int(hints["retry-after-ms"]) >= 1
    with Client(busy_cluster.coordinator) as client:  # the stage serves the next request
        assert client.generate("after", **SMALL).size == (64, 64)


def test_client_deadline_reaches_the_stages_and_stops_the_work(busy_cluster: InProcessCluster) -> None:
    with Client(busy_cluster.coordinator) as client:
        with pytest.raises(DeadlineExceeded):
            client.generate("too slow", timeout=1.0, **{**SMALL, "steps": 1000})
        # The DiT dropped it at a step boundary: the next request is served at once.
        started = time.monotonic()
        assert client.generate("next", **SMALL).size == (64, 64)
        assert time.monotonic() - started < 10
    wait_until_no_leases(busy_cluster)


def test_coordinator_in_flight_limit_is_resource_exhausted(tiny_model: Path) -> None:
    small = InProcessCluster(tiny_model, coordinator_options={"max_in_flight": 1})
    small.start()
    try:
        with Client(small.coordinator) as client:
            events = client.events("hold", **{**SMALL, "steps": 300})
            next(events)  # accepted: one request in flight
            with pytest.raises(ResourceExhausted, match="in flight"):
                client.generate("refused", **SMALL)
            events.close()
        wait_until_no_leases(small)
    finally:
        small.stop()


def test_a_burst_encoded_in_waves_starts_denoising_in_one_batch(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder takes one prompt at a time, each forward 40 ms (as a real text encoder's),
    so 4 requests sent at once reach the DiT 40 ms apart. Each DiT call says how many like it
    the coordinator still has in the encoder, and the DiT holds the first step for them: 4
    requests of 4 steps take 4 forwards, not a forward for each late one."""
    embed_texts = QwenImageEncoder.embed_texts

    def slow_embed_texts(self: QwenImageEncoder, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.04)
        return embed_texts(self, *args, **kwargs)

    monkeypatch.setattr(QwenImageEncoder, "embed_texts", slow_embed_texts)
    port = free_port()
    burst = InProcessCluster(
        tiny_model, stage_options={"ar-encoder": {"max_batch": 1}, "dit-denoise": {"metrics_port": port}}
    )
    burst.start()
    try:

        async def main() -> list[object]:
            async with AsyncClient(burst.coordinator) as client:
                sent = (client.generate_result(f"a burst, prompt {i}", seed=i, **SMALL) for i in range(4))
                return list(await asyncio.gather(*sent))

        assert all(result.image.size == (64, 64) for result in asyncio.run(main()))  # type: ignore[attr-defined]
        labels = frozenset({"stage": "dit-denoise", "role": "denoise"}.items())
        assert scrape(port)[("omnistage_steps", labels)] == SMALL["steps"]
    finally:
        burst.stop()
