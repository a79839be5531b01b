"""A dit-denoise replica over two worker processes (--devices cpu,cpu) loses one worker mid-request:
its requests resume on the other DiT replica from their checkpoints with equal images, and the
replica reports NOT_SERVING and leaves the coordinator's routing."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan, stage_process
from omni_common.errors import OmniError
from omni_common.runtime.rpc import sync_channel
from tests.conftest import omnistage_segments
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
        for thread in threads:
            thread.join(300)
        for seed in requests:
            assert not isinstance(results[seed], OmniError), (seed, results[seed])
            np.testing.assert_allclose(results[seed], expected[seed], atol=IMAGE_TOL, rtol=0)  # type: ignore[arg-type]

        with sync_channel(group.health_address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert server.poll() is None, "the server process stays up (an orchestrator restarts it)"
        deadline = time.monotonic() + 10
        while device_workers(server.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not device_workers(server.pid), "the surviving worker was left waiting for its peer"
        with Client(cluster.coordinator) as client:
            assert client.list_models()[0].replicas["dit-denoise"] == 1
        assert cluster.log_dir is not None
        coordinator_log = (cluster.log_dir / "coordinator.log").read_text()
        group_log = (cluster.log_dir / "dit-denoise-group.log").read_text()
    assert f"dit-denoise replica {group.health_address}" in coordinator_log and "moving on" in coordinator_log
    assert "lost a device worker" in group_log or "stops serving" in group_log
    assert omnistage_segments() == before
