"""Per-stage scaling and failover with real processes: a DiT replica killed mid-request,
replicas added and drained under load, and a coordinator restart lose no request."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from omni_common.client import Client, ResultBuilder
from omni_common.cluster import LocalCluster, loopback_plan, stage_process
from omni_common.errors import OmniError
from tests.conftest import assert_no_segment_added, omnistage_segments
from tests.e2e.conftest import kill_mid_denoise

pytestmark = pytest.mark.slow

# Long enough that the requests are still denoising a second after they start.
REQUEST = {"width": 64, "height": 64, "steps": 200, "return_tensor": True}


def requests(seeds: list[int]) -> dict[int, dict[str, object]]:
    return {seed: {"prompt": f"prompt {seed}", "seed": seed, **REQUEST} for seed in seeds}


def test_killed_dit_replica_requests_resume_elsewhere_with_equal_images(
    tiny_model: Path, tmp_path: Path
) -> None:
    before = omnistage_segments()
    seeds = list(range(8))
    plan = loopback_plan(tiny_model, replicas={"dit-denoise": 2})
    with LocalCluster(plan, log_dir=tmp_path) as cluster:
        log = kill_mid_denoise(cluster, requests(seeds))
    assert "dit-denoise replica" in log and "moving on" in log, "no request failed over"
    assert_no_segment_added(before)


def test_a_dit_request_resumes_after_its_pod_and_its_shared_memory_are_gone(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Each DiT replica stands for a pod of its own (its host id, its /dev/shm); the killed
    one's shared memory is removed with it. Its requests resume from their checkpoints, which
    the coordinator holds in its own store, not from step 0."""
    pods = {"dit-denoise": tmp_path / "pod-a", "dit-denoise-2": tmp_path / "pod-b"}
    plan = loopback_plan(tiny_model, replicas={"dit-denoise": 2})
    for i, proc in enumerate(plan):
        if proc.name in pods:
            pods[proc.name].mkdir()
            # Inline checkpoints (the tiny model's are 4 KiB) would travel in the message.
            pod = {"OMNISTAGE_HOST_ID": proc.name, "OMNISTAGE_SHM_DIR": str(pods[proc.name])}
            pod["OMNISTAGE_INLINE_BYTES"] = "0"
            plan[i] = replace(proc, environment={**proc.environment, **pod})
    with LocalCluster(plan, log_dir=tmp_path / "logs") as cluster:
        deleted = lambda: shutil.rmtree(pods["dit-denoise"])  # noqa: E731
        # Past step 6, each request's checkpoint of step 5 is in the coordinator's store.
        log = kill_mid_denoise(cluster, requests(list(range(6))), after_kill=deleted, past_step=6)
    assert "moving on" in log, "no request failed over"
    assert "from its checkpoint" in log and "checkpoint gone" not in log


def test_scaling_dit_up_and_down_under_a_steady_stream_fails_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    with LocalCluster(loopback_plan(tiny_model), log_dir=tmp_path) as cluster:
        stop = threading.Event()
        outcomes: list[object] = []

        def stream(worker: int) -> None:
            with Client(cluster.coordinator) as client:
                i = 0
                while not stop.is_set():
                    try:
                        client.generate(f"steady {worker}", seed=i, width=64, height=64, steps=8)
                        outcomes.append("ok")
                    except OmniError as err:
                        outcomes.append(err)
                    i += 1

        workers = [threading.Thread(target=stream, args=(w,)) for w in range(3)]
        for worker in workers:
            worker.start()
        for i in (2, 3):  # 1 -> 3 replicas
            cluster.add(stage_process("dit-denoise", tiny_model, cluster.coordinator, f"dit-denoise-{i}"))
        time.sleep(2.0)
        with Client(cluster.coordinator) as client:
            assert client.list_models()[0].replicas["dit-denoise"] == 3
        for name in ("dit-denoise-2", "dit-denoise-3"):  # 3 -> 1: drain
            cluster.processes[name].send_signal(signal.SIGTERM)
        for name in ("dit-denoise-2", "dit-denoise-3"):
            assert cluster.processes[name].wait(60) == 0
        time.sleep(1.0)
        stop.set()
        for worker in workers:
            worker.join(60)
    failures = [o for o in outcomes if o != "ok"]
    assert not failures, failures
    assert len(outcomes) >= 6


def test_restarted_coordinator_gets_every_replica_back(tiny_model: Path, tmp_path: Path) -> None:
    with LocalCluster(loopback_plan(tiny_model), log_dir=tmp_path) as cluster:
        coordinator = next(p for p in cluster.plan if p.name == "coordinator")
        old = cluster.processes["coordinator"]
        old.send_signal(signal.SIGTERM)
        assert old.wait(30) == 0
        cluster.plan.remove(coordinator)
        cluster.add(coordinator)
        cluster.wait_registered(30)
        with Client(cluster.coordinator) as client:
            assert client.generate("after the restart", width=64, height=64, steps=4).size == (64, 64)


def test_a_request_waits_for_a_restarted_stage_instead_of_failing(tiny_model: Path, tmp_path: Path) -> None:
    """The only VAE replica is killed; a request then waits (and says so) until a new one has
    registered, and gets the image it got before the kill."""
    request = {"prompt": "waits for its decoder", "seed": 3, "width": 64, "height": 64, "steps": 4}
    with (
        LocalCluster(loopback_plan(tiny_model), log_dir=tmp_path) as cluster,
        Client(cluster.coordinator) as client,
    ):
        expected = client.generate_result(return_tensor=True, **request).tensor  # type: ignore[arg-type]
        cluster.processes["vae-decode"].send_signal(signal.SIGKILL)
        cluster.processes["vae-decode"].wait(10)
        restart = threading.Timer(
            1.0,
            lambda: cluster.add(stage_process("vae-decode", tiny_model, cluster.coordinator, "vae-decode-2")),
        )
        restart.start()
        events = list(client.events(return_tensor=True, **request))  # type: ignore[arg-type]
        restart.join()
    waits = [e.waiting for e in events if e.HasField("waiting")]
    assert [(w.stage, w.step) for w in waits] == [("vae-decode", "decode")] and waits[0].max_wait_ms > 0
    builder = ResultBuilder()
    for event in events:
        builder.add(event)
    got = builder.build().tensor
    assert got is not None and expected is not None and (got == expected).all()
