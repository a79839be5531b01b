"""A dit-denoise replica over two worker processes (--devices cpu,cpu) loses one worker mid-request:
its requests resume on the other DiT replica from their checkpoints with equal images, and the
replica reports NOT_SERVING, leaves the coordinator's routing, drains and exits with an error
(its supervisor restarts it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan, stage_process
from omni_common.errors import OmniError, Unavailable
from omni_common.net.rpc import sync_channel
from tests.conftest import assert_no_segment_added, omnistage_segments
from tests.e2e.conftest import IMAGE_TOL, generate_all

pytestmark = pytest.mark.slow

REQUEST = {"width": 64, "height": 64, "steps": 200, "return_tensor": True}


def device_workers(server_pid: int) -> list[int]:
    """The device worker processes a replica's server started (multiprocessing's spawn children)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == server_pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def not_serving_soon(address: str, timeout_s: float = 10.0) -> bool:
    """Whether the replica's health turns NOT_SERVING within `timeout_s` (polled fast: the
    replica exits once drained)."""
    deadline = time.monotonic() + timeout_s
    with sync_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                return False  # gone before it was seen not serving
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return True
            time.sleep(0.01)
    return False


def test_a_dead_device_worker_fails_the_replica_over(tiny_model: Path, tmp_path: Path) -> None:
    before = omnistage_segments()
    plan = loopback_plan(tiny_model)
    group = stage_process(
        "dit-denoise",
        tiny_model,
        plan[0].health_address,
        "dit-denoise-group",
        {"OMNISTAGE_DEVICES": "cpu,cpu", "OMNISTAGE_THREADS": "1"},
    )
    with LocalCluster([*plan, group], log_dir=tmp_path) as cluster:
        server = cluster.processes["dit-denoise-group"]
        workers = device_workers(server.pid)
        assert len(workers) == 2, workers
        requests = {seed: {"prompt": f"prompt {seed}", "seed": seed, **REQUEST} for seed in range(6)}
        expected: dict[int, object] = {}
        for thread in generate_all(cluster.coordinator, requests, expected):
            thread.join(300)
        results: dict[int, object] = {}
        denoising = threading.Semaphore(0)
        threads = generate_all(cluster.coordinator, requests, results, denoising)
        for _ in requests:
            assert denoising.acquire(timeout=120)
        assert not results, "the requests finished before the kill: make them longer"
        os.kill(workers[1], signal.SIGKILL)
        assert not_serving_soon(group.health_address), "the replica kept reporting SERVING"
        for thread in threads:
            thread.join(300)
        for seed in requests:
            assert not isinstance(results[seed], OmniError), (seed, results[seed])
            np.testing.assert_allclose(results[seed], expected[seed], atol=IMAGE_TOL, rtol=0)
        # Drained (the coordinator released what it held there), the server exits with an
        # error for its supervisor to restart it; the other worker does not outlive it.
        assert server.wait(60) != 0
        assert not any(alive(pid) for pid in workers), "the surviving worker was left behind"
        with Client(cluster.coordinator) as client:
            assert client.list_models()[0].replicas["dit-denoise"] == 1
        assert cluster.log_dir is not None
        coordinator_log = (cluster.log_dir / "coordinator.log").read_text()
        group_log = (cluster.log_dir / "dit-denoise-group.log").read_text()
    assert f"dit-denoise replica {group.health_address}" in coordinator_log and "moving on" in coordinator_log
    assert "lost a device worker" in group_log or "stops serving" in group_log
    assert_no_segment_added(before)


def test_a_lone_replica_that_loses_a_worker_fails_its_requests_with_a_clear_status(
    tiny_model: Path, tmp_path: Path
) -> None:
    """With no other DiT replica to resume on, the request ends UNAVAILABLE, saying why."""
    plan = loopback_plan(tiny_model, extra_env={"OMNISTAGE_REPLICA_WAIT_S": "1"}, replicas={"dit-denoise": 0})
    group = stage_process(
        "dit-denoise",
        tiny_model,
        plan[0].health_address,
        "dit-denoise-group",
        {"OMNISTAGE_DEVICES": "cpu,cpu", "OMNISTAGE_THREADS": "1"},
    )
    with LocalCluster([*plan, group], log_dir=tmp_path) as cluster:
        workers = device_workers(cluster.processes["dit-denoise-group"].pid)
        results: dict[int, object] = {}
        denoising = threading.Semaphore(0)
        threads = generate_all(cluster.coordinator, {0: {"prompt": "alone", **REQUEST}}, results, denoising)
        assert denoising.acquire(timeout=120)
        os.kill(workers[0], signal.SIGKILL)
        for thread in threads:
            thread.join(120)
    error = results[0]
    assert isinstance(error, Unavailable), error
    assert "dit-denoise" in error.message and "retry" in error.message
