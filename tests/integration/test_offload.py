"""Device memory through real servers: StageControl sleep/wake, the coordinator's swap
policy and the DiT's layerwise offload each give the same images as everything resident."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.client import Client
from omni_common.net.rpc import sync_channel
from omni_common.runtime.stage_control import AWAKE_SERVICE
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from tests.integration.conftest import InProcessCluster
from tests.integration.test_concurrency import IMAGE_TOL
from tests.integration.test_generate import wait_until_no_leases

SMALL = {"width": 64, "height": 64, "steps": 4}
SEEDS = (1, 2, 3, 4)


def image(cluster: InProcessCluster, seed: int) -> np.ndarray:
    """The raw float image of one request (CFG on, so every stage does full work)."""
    with Client(cluster.coordinator) as client:
        result = client.generate_result(
            "a lamp", negative_prompt="blurry", guidance=4.0, seed=seed, return_tensor=True, **SMALL
        )
        return np.asarray(result.tensor)


def images(cluster: InProcessCluster, seeds: tuple[int, ...] = SEEDS) -> dict[int, np.ndarray]:
    """One request at a time, so no two share a batch: the images are then bitwise stable."""
    return {seed: image(cluster, seed) for seed in seeds}


def concurrent_images(cluster: InProcessCluster) -> dict[int, np.ndarray]:
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return dict(zip(SEEDS, pool.map(lambda seed: image(cluster, seed), SEEDS), strict=True))


def started(cluster: InProcessCluster) -> Iterator[InProcessCluster]:
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def resident(tiny_model: Path) -> dict[int, np.ndarray]:
    cluster = InProcessCluster(tiny_model)
    cluster.start()
    try:
        return images(cluster)
    finally:
        cluster.stop()


def info(address: str) -> stage_pb2.StageInfo:
    with sync_channel(address) as channel:
        return stage_pb2_grpc.StageStub(channel).Info(stage_pb2.StageInfoRequest(), timeout=10)


def awake_health(address: str) -> int:
    with sync_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=AWAKE_SERVICE)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def control(address: str) -> stage_pb2_grpc.StageControlStub:
    return stage_pb2_grpc.StageControlStub(sync_channel(address))


def assert_same(got: dict[int, np.ndarray], want: dict[int, np.ndarray], atol: float = 0.0) -> None:
    assert got.keys() == want.keys()
    for seed in want:
        np.testing.assert_allclose(got[seed], want[seed], atol=atol, rtol=0, err_msg=f"seed {seed}")


def test_swap_policy_takes_turns_and_gives_the_same_images(tiny_model: Path, resident) -> None:
    # On CPUs the device's memory is unknown (0), so the budget admits one stage at a time.
    cluster = InProcessCluster(tiny_model, coordinator_options={"offload": "swap"})
    for running in started(cluster):
        assert_same(images(running), resident)
        # Concurrent requests queue per phase and share DiT batches: equal up to batching's
        # float rounding (see test_concurrency.IMAGE_TOL).
        assert_same(concurrent_images(running), resident, atol=IMAGE_TOL)
        asleep = {stage: info(running.addresses[stage]).asleep for stage in ("ar-encoder", "dit-denoise")}
        assert asleep == {"ar-encoder": True, "dit-denoise": True}  # the VAE ran last
        assert not info(running.addresses["vae-decode"]).asleep
        assert awake_health(running.addresses["dit-denoise"]) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert info(running.addresses["dit-denoise"]).weight_bytes > 0
        wait_until_no_leases(running)


def test_layerwise_offload_gives_the_same_images(tiny_model: Path, resident) -> None:
    cluster = InProcessCluster(tiny_model, stage_options={"dit-denoise": {"offload": "layerwise"}})
    for running in started(cluster):
        assert_same(images(running), resident)
        # Layerwise keeps the blocks in host memory already: level 2 would reload nothing useful.
        with pytest.raises(grpc.RpcError) as refused:
            control(running.addresses["dit-denoise"]).Sleep(stage_pb2.SleepRequest(level=2), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_stage_wakes_for_a_call_and_serves_the_same_image(cluster, resident, level: int) -> None:
    dit = cluster.addresses["dit-denoise"]
    slept = control(dit).Sleep(stage_pb2.SleepRequest(level=level), timeout=30)
    assert (slept.level, slept.awake) == (level, False) and slept.bytes == info(dit).weight_bytes
    assert info(dit).asleep and awake_health(dit) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert_same(images(cluster, (1,)), {1: resident[1]})
    assert not info(dit).asleep and awake_health(dit) == health_pb2.HealthCheckResponse.SERVING
    assert control(dit).Wake(stage_pb2.WakeRequest(), timeout=30).level == 0  # already awake


def test_sleep_is_refused_while_calls_are_in_flight_and_for_unknown_levels(cluster) -> None:
    dit = control(cluster.addresses["dit-denoise"])
    with pytest.raises(grpc.RpcError) as bad_level:
        dit.Sleep(stage_pb2.SleepRequest(level=3), timeout=10)
    assert bad_level.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    denoising = threading.Event()

    def long_request() -> None:
        with Client(cluster.coordinator) as client:
            for event in client.events("a lamp", width=64, height=64, steps=200):
                if event.HasField("step"):
                    denoising.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert denoising.wait(30)
    with pytest.raises(grpc.RpcError) as busy:
        dit.Sleep(stage_pb2.SleepRequest(level=1), timeout=10)
    worker.join(60)
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "in flight" in (busy.value.details() or "")
    assert not info(cluster.addresses["dit-denoise"]).asleep
