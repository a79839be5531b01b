"""A dit-denoise replica over two gloo worker processes (--devices cpu,cpu) in a cluster of real
gRPC servers: its images against a cluster whose DiT runs on one device in its own process.

allclose, not bitwise: sequence parallel attends with a share of the heads per rank and CFG
parallel runs each branch as its own forward; measured on the tiny fixture at 64x64, 4 steps,
fp32: at most ~1e-6 on the image (printed by the test).
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from threading import Thread

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.client import Client
from omni_common.net.rpc import sync_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from tests.integration.conftest import InProcessCluster

pytestmark = pytest.mark.slow

SMALL = {"width": 64, "height": 64, "steps": 4, "return_tensor": True}
IMAGE_TOLERANCE = 1e-5  # the float image in [0, 1]; measured worst ~1e-6


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles") / "root"  # made by the replica


@pytest.fixture(scope="module")
def spread(tiny_model: Path, profile_root: Path) -> Iterator[InProcessCluster]:
    """The same cluster with its DiT replica over two CPU worker processes. Its server process
    sets torch's threads to 1 (it computes nothing): restored after, or later clusters in this
    test process would add in another order than their references (4e-7 apart)."""
    threads = torch.get_num_threads()
    # Every request over both workers: --parallel-mode auto would give the tiny images one each.
    options = {
        "devices": ("cpu", "cpu"),
        "threads": 1,
        "parallel_mode": "sequence-parallel",
        "profile_dir": str(profile_root),
    }
    running = InProcessCluster(tiny_model, stage_options={"dit-denoise": options})
    running.start()
    yield running
    running.stop()
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "params",
    [{"seed": 5}, {"seed": 6, "negative_prompt": "blurry", "guidance": 4.0}],
    ids=["no-cfg", "cfg"],
)
def test_two_workers_draw_the_one_device_image(
    cluster: InProcessCluster, spread: InProcessCluster, params: dict[str, object]
) -> None:
    with Client(cluster.coordinator) as client:
        one = client.generate_result("a red cat", **SMALL, **params)
    with Client(spread.coordinator) as client:
        two = client.generate_result("a red cat", **SMALL, **params)
    assert one.tensor is not None and two.tensor is not None
    worst = float(np.abs(one.tensor - two.tensor).max())
    print(f"max |2 workers - 1 device| on the image ({sorted(params)}): {worst:.3g}")
    assert worst <= IMAGE_TOLERANCE


def test_concurrent_requests_each_get_their_own_image(
    cluster: InProcessCluster, spread: InProcessCluster
) -> None:
    """Requests that overlap share the group's steps (continuous batching) and still each end
    as their one-device image."""
    prompts = ["a dog", "a small house near a tree", "the sky at sunset"]
    got: dict[str, np.ndarray] = {}

    def one(prompt: str) -> None:
        with Client(spread.coordinator) as client:
            result = client.generate_result(prompt, seed=1, **SMALL)
            assert result.tensor is not None
            got[prompt] = result.tensor

    threads = [Thread(target=one, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    with Client(cluster.coordinator) as client:
        for prompt in prompts:
            expected = client.generate_result(prompt, seed=1, **SMALL).tensor
            assert expected is not None
            assert float(np.abs(got[prompt] - expected).max()) <= IMAGE_TOLERANCE, prompt


def test_the_replica_is_one_stage_replica_naming_its_devices(spread: InProcessCluster) -> None:
    with sync_channel(spread.addresses["dit-denoise"]) as channel:
        info = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.StageInfoRequest(), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert info.device == "cpu,cpu" and info.stage == "dit-denoise" and info.roles == ["denoise"]
    assert info.weight_bytes > 0
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(spread.coordinator) as client:
        assert client.list_models()[0].replicas["dit-denoise"] == 1


def test_what_does_not_spread_yet_is_refused_cleanly(spread: InProcessCluster, tmp_path: Path) -> None:
    """LoRA adapters, weight pushes and sleep on a replica over several devices: a status that
    says so, and the replica still serves."""
    with sync_channel(spread.addresses["dit-denoise"]) as channel:
        control = stage_pb2_grpc.StageControlStub(channel)
        add = stage_pb2.AddLoraRequest(name="ink", path=str(tmp_path))
        push = stage_pb2.LoadWeightsRequest(paths=[str(tmp_path)])
        calls = [
            (lambda: control.AddLora(add), "UNIMPLEMENTED"),
            (lambda: control.LoadWeights(push), "UNIMPLEMENTED"),
            (lambda: control.Sleep(stage_pb2.SleepRequest(level=1)), "FAILED_PRECONDITION"),
        ]
        for call, code in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code().name == code, caught.value.details()
    with Client(spread.coordinator) as client:
        assert client.generate_result("still serving", **SMALL).tensor is not None


def written(directory: Path, timeout_s: float = 60.0) -> Callable[[], list[Path]]:
    """The traces under `directory`, waited for: a rank's merge process writes its trace after
    StopProfile has answered."""

    def traces() -> list[Path]:
        deadline = time.monotonic() + timeout_s
        while not (found := sorted(directory.glob("*.json"))) and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    return traces


def test_a_profile_records_the_server_and_every_rank(spread: InProcessCluster, profile_root: Path) -> None:
    """StartProfile on a replica over two workers: the server's trace (its scheduling, its
    waits for the ranks) and one per rank in rank-N/ beside it, each with that rank's forwards
    and the collectives of sequence parallel, owner-only."""
    with sync_channel(spread.addresses["dit-denoise"]) as channel:
        control = stage_pb2_grpc.StageControlStub(channel)
        control.StartProfile(stage_pb2.StartProfileRequest(name="ranks"), timeout=60)
        with Client(spread.coordinator) as client:
            assert client.generate_result("a red cat", **SMALL).tensor is not None
        reply = control.StopProfile(stage_pb2.StopProfileRequest(), timeout=120)
    trace = Path(reply.path)
    assert trace.is_file() and trace.parent == profile_root / "ranks"
    for rank in (0, 1):
        found = written(trace.parent / f"rank-{rank}")()
        assert len(found) == 1, f"rank {rank}: {found}"
        assert stat.S_IMODE(found[0].stat().st_mode) == 0o600
        names = {event.get("name", "") for event in json.loads(found[0].read_text())["traceEvents"]}
        assert any("alltoall" in name.replace("_", "") for name in names), f"rank {rank}: no all-to-all"
        assert any(name.startswith("aten::scaled_dot_product_attention") for name in names)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "rank_profile.py"
    printed = subprocess.run(
        [sys.executable, str(script), str(trace.parent), "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    summaries = [json.loads(line) for line in printed.splitlines()]
    assert [s["rank"] for s in summaries] == [0, 1]
    for summary in summaries:  # every step of the request, on each rank
        assert summary["steps"] == SMALL["steps"] and summary["step_ms"] > 0, summary
