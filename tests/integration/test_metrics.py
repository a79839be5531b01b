"""Every stage replica and the coordinator serve Prometheus metrics over HTTP, scraped here
for real while requests run through real servers."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from omni_common.client import Client
from omni_common.cluster import free_port
from omni_common.errors import NotFound
from omni_common.net.rpc import sync_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from tests.integration.conftest import WORKERS, InProcessCluster, Samples, scrape

# 64x64 packs into (64/16)^2 image tokens; many steps keep the DiT busy long enough to watch.
TOKENS = (64 // 16) ** 2
STEPS = 300


@pytest.fixture(scope="module")
def metered(tiny_model: Path) -> Iterator[tuple[InProcessCluster, dict[str, int]]]:
    ports = {name: free_port() for name in (*WORKERS, "coordinator")}
    running = InProcessCluster(
        tiny_model,
        stage_options={stage: {"metrics_port": ports[stage]} for stage in WORKERS},
        coordinator_options={"metrics_port": ports["coordinator"]},
    )
    running.start()
    yield running, ports
    running.stop()


def stage_value(samples: Samples, name: str, stage: str, **labels: str) -> float:
    return samples.get((name, frozenset({"stage": stage, **labels}.items())), 0.0)


def test_dit_load_rises_while_a_request_denoises_and_falls_after(
    metered: tuple[InProcessCluster, dict[str, int]],
) -> None:
    cluster, ports = metered
    dit = ports["dit-denoise"]
    before = {name: scrape(port) for name, port in ports.items()}
    assert stage_value(before["dit-denoise"], "omnistage_stage_load", "dit-denoise") == 0
    for stage in WORKERS:
        assert before["coordinator"][("omnistage_coordinator_replicas", frozenset({("stage", stage)}))] == 1

    done = threading.Event()

    def generate() -> None:
        with Client(cluster.coordinator) as client:
            client.generate("a lamp", width=64, height=64, steps=STEPS, guidance=1.0)
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    loads, coordinator_in_flight = [], []
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        loads.append(stage_value(scrape(dit), "omnistage_stage_load", "dit-denoise"))
        coordinator_in_flight.append(
            scrape(ports["coordinator"])[("omnistage_coordinator_requests_in_flight", frozenset())]
        )
        time.sleep(0.01)
    worker.join(120)
    assert done.is_set(), "the request did not finish"

    busy = [load for load in loads if load > 0]
    assert busy, f"the DiT's load never rose above 0 in {len(loads)} scrapes during the request"
    # Remaining steps x image tokens: the very number the replica heartbeats.
    assert all(load % TOKENS == 0 and load <= STEPS * TOKENS for load in busy), busy
    assert max(coordinator_in_flight) == 1

    after = {name: scrape(port) for name, port in ports.items()}
    assert stage_value(after["dit-denoise"], "omnistage_stage_load", "dit-denoise") == 0
    assert stage_value(after["dit-denoise"], "omnistage_stage_in_flight", "dit-denoise") == 0
    for stage in WORKERS:
        served = "omnistage_stage_requests_served_total"
        assert stage_value(after[stage], served, stage) == stage_value(before[stage], served, stage) + 1
    completed = ("omnistage_coordinator_requests_completed_total", frozenset())
    assert after["coordinator"][completed] == before["coordinator"][completed] + 1
    assert after["coordinator"][("omnistage_coordinator_requests_in_flight", frozenset())] == 0


def test_failed_requests_are_counted_by_status_code(
    metered: tuple[InProcessCluster, dict[str, int]],
) -> None:
    cluster, ports = metered
    with Client(cluster.coordinator) as client, pytest.raises(NotFound):
        client.generate("a lamp", width=64, height=64, steps=2, model="not-served")
    failed = ("omnistage_coordinator_requests_failed_total", frozenset({("code", "NOT_FOUND")}))
    assert scrape(ports["coordinator"])[failed] == 1

    request = stage_pb2.StageRequest(
        request_id="wrong-model", params=stage_pb2.GenerationParams(model="not-served", prompt="x")
    )
    with sync_channel(cluster.addresses["vae-decode"]) as channel, pytest.raises(grpc.RpcError) as caught:
        list(stage_pb2_grpc.StageStub(channel).Run(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    samples = scrape(ports["vae-decode"])
    assert stage_value(samples, "omnistage_stage_requests_failed_total", "vae-decode", code="NOT_FOUND") == 1


def test_only_get_metrics_is_served(metered: tuple[InProcessCluster, dict[str, int]]) -> None:
    port = metered[1]["ar-encoder"]
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    assert caught.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", data=b"x", timeout=5)
    assert caught.value.code == 405
    assert ("omnistage_stage_load", frozenset({("stage", "ar-encoder")})) in scrape(port)
