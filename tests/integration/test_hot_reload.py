"""StageControl.LoadWeights through real servers: weights pushed while requests run. Requests
before, during and after the push all succeed; afterwards the images equal those of a fresh
cluster started on the new weights, bit for bit (whole or in two partial pushes, and across a
sleep of either level); bad pushes are refused and change nothing."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_common.client import Client
from omni_common.net.rpc import sync_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage_cli import main as cli
from tests.integration.conftest import InProcessCluster

SMALL = {"width": 64, "height": 64, "steps": 3}
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def new_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every DiT weight moved by seeded noise: the weights a trainer pushes."""
    root = tmp_path_factory.mktemp("pushed")
    shutil.copytree(tiny_model, root / "model")
    weights = load_file(str(tiny_model / WEIGHTS))
    generator = torch.Generator().manual_seed(7)
    moved = {
        name: (t + 0.02 * torch.randn(t.shape, generator=generator, dtype=t.dtype))
        if t.is_floating_point()
        else t
        for name, t in weights.items()
    }
    save_file(moved, str(root / "model" / WEIGHTS))
    return root / "model"


@pytest.fixture(scope="module")
def fresh_images(new_model: Path) -> dict[int, np.ndarray]:
    """What a cluster started on the new weights draws."""
    cluster = InProcessCluster(new_model)
    cluster.start()
    try:
        return {seed: generate(cluster, seed) for seed in (1, 2)}
    finally:
        cluster.stop()


@pytest.fixture
def cluster(tiny_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(tiny_model)
    running.start()
    yield running
    running.stop()


def generate(cluster: InProcessCluster, seed: int, steps: int = SMALL["steps"]) -> np.ndarray:
    with Client(cluster.coordinator) as client:
        result = client.generate_result(
            "a lamp", seed=seed, return_tensor=True, width=SMALL["width"], height=SMALL["height"], steps=steps
        )
        return np.asarray(result.tensor)


def wait_for_dit_work(cluster: InProcessCluster) -> None:
    """Until the DiT has requests in flight (its StageInfo.queue_depth)."""
    deadline = time.monotonic() + 30
    with sync_channel(cluster.addresses["dit-denoise"]) as channel:
        stage = stage_pb2_grpc.StageStub(channel)
        while stage.Info(stage_pb2.StageInfoRequest(), timeout=5).queue_depth == 0:
            assert time.monotonic() < deadline, "no request reached the DiT"
            time.sleep(0.005)


def load(cluster: InProcessCluster, *paths: Path) -> stage_pb2.LoadWeightsReply:
    with sync_channel(cluster.addresses["dit-denoise"]) as channel:
        request = stage_pb2.LoadWeightsRequest(paths=[str(p) for p in paths])
        return stage_pb2_grpc.StageControlStub(channel).LoadWeights(request, timeout=60)


def test_requests_before_during_and_after_a_push_succeed_and_end_on_the_new_weights(
    cluster: InProcessCluster, new_model: Path, fresh_images: dict[int, np.ndarray]
) -> None:
    before = generate(cluster, 1)
    assert not np.array_equal(before, fresh_images[1])  # the push changes the image
    with ThreadPoolExecutor(3) as pool:
        during = [pool.submit(generate, cluster, seed, 80) for seed in (3, 4, 5)]
        wait_for_dit_work(cluster)
        reply = load(cluster, new_model / "transformer")  # a directory: all its safetensors
        assert not all(future.done() for future in during)
        results = [future.result(120) for future in during]
    assert reply.tensors == len(load_file(str(new_model / WEIGHTS))) and reply.bytes > 0
    assert all(np.isfinite(image).all() and image.std() > 0 for image in results)
    assert np.array_equal(generate(cluster, 1), fresh_images[1])
    assert np.array_equal(generate(cluster, 2), fresh_images[2])


def test_two_partial_pushes_make_the_whole(
    cluster: InProcessCluster, new_model: Path, fresh_images: dict[int, np.ndarray], tmp_path: Path
) -> None:
    weights = load_file(str(new_model / WEIGHTS))
    names = sorted(weights)
    save_file({n: weights[n] for n in names[::2]}, str(tmp_path / "even.safetensors"))
    save_file({n: weights[n] for n in names[1::2]}, str(tmp_path / "odd.safetensors"))
    assert load(cluster, tmp_path / "even.safetensors").tensors == len(names[::2])
    half = generate(cluster, 1)
    assert not np.array_equal(half, fresh_images[1])
    load(cluster, tmp_path / "odd.safetensors")
    assert np.array_equal(generate(cluster, 1), fresh_images[1])


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_after_a_push_keeps_the_new_weights(
    level: int, cluster: InProcessCluster, new_model: Path, fresh_images: dict[int, np.ndarray]
) -> None:
    with sync_channel(cluster.addresses["dit-denoise"]) as channel:
        control = stage_pb2_grpc.StageControlStub(channel)
        control.Sleep(stage_pb2.SleepRequest(level=1), timeout=30)  # a host copy of the old weights
        control.Wake(stage_pb2.WakeRequest(), timeout=30)
        load(cluster, new_model / WEIGHTS)
        control.Sleep(stage_pb2.SleepRequest(level=level), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            load(cluster, new_model / WEIGHTS)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        control.Wake(stage_pb2.WakeRequest(), timeout=60)
    assert np.array_equal(generate(cluster, 1), fresh_images[1])


def test_bad_pushes_are_refused_and_change_nothing(
    cluster: InProcessCluster, tiny_model: Path, tmp_path: Path
) -> None:
    before = generate(cluster, 1)
    weights = load_file(str(tiny_model / WEIGHTS))
    name = next(n for n in weights if n.endswith("to_q.weight"))
    bad = {
        "unknown": {"no.such.weight": torch.zeros(2)},
        "shape": {name: torch.zeros(3, 3)},
        "nan": {
            "proj_out.weight": weights["proj_out.weight"],
            name: torch.full_like(weights[name], float("nan")),
        },
    }
    for what, tensors in bad.items():
        save_file(tensors, str(tmp_path / f"{what}.safetensors"))
        with pytest.raises(grpc.RpcError) as err:
            load(cluster, tmp_path / f"{what}.safetensors")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    for paths, code in (
        ((tmp_path / "absent.safetensors",), grpc.StatusCode.NOT_FOUND),
        ((), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as err:
            load(cluster, *paths)
        assert err.value.code() == code
    with sync_channel(cluster.addresses["vae-decode"]) as channel:
        with pytest.raises(grpc.RpcError) as err:  # the VAE's own weights: a DiT name is unknown
            request = stage_pb2.LoadWeightsRequest(paths=[str(tiny_model / WEIGHTS)])
            stage_pb2_grpc.StageControlStub(channel).LoadWeights(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert np.array_equal(generate(cluster, 1), before)


def test_a_profile_of_the_dit_writes_a_chrome_trace(tiny_model: Path, tmp_path: Path) -> None:
    cluster = InProcessCluster(tiny_model, stage_options={"dit-denoise": {"profile_dir": str(tmp_path)}})
    cluster.start()
    try:
        trace = profile(cluster, tmp_path)
    finally:
        cluster.stop()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("linear" in str(event.get("name", "")) for event in events)  # the DiT's forwards


def profile(cluster: InProcessCluster, tmp_path: Path) -> Path:
    """Refused calls, then `omnistage profile ADDRESS --seconds 1.5` while requests run; the
    trace file the CLI prints."""
    with sync_channel(cluster.addresses["dit-denoise"]) as channel:
        control = stage_pb2_grpc.StageControlStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            control.StopProfile(stage_pb2.StopProfileRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for name in ("../up", "/abs", "a/b"):
            with pytest.raises(grpc.RpcError) as err:
                control.StartProfile(stage_pb2.StartProfileRequest(name=name), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    output = io.StringIO()
    argv = ["profile", cluster.addresses["dit-denoise"], "--seconds", "1.5", "--name", "trace"]
    with ThreadPoolExecutor(1) as pool, contextlib.redirect_stdout(output):
        done = pool.submit(cli.main, argv)
        while not done.done():
            generate(cluster, 1)
        assert done.result() == 0
    reply = json.loads(output.getvalue())
    trace = Path(reply["path"])
    assert trace.parent == tmp_path / "trace" and reply["seconds"] >= 1.5
    return trace
