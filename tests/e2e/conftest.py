"""Real processes: each service started through the `omnistage` CLI, as in production."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from omni_common.client import Client, ResultBuilder
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.errors import OmniError


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def process_cluster(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(coordinator address, dtype) of a cluster of real processes."""
    dtype = request.param
    # fp32 keeps the default inline threshold (small hops inline); bf16 sends every hop
    # through shared memory, so both paths are checked across real processes.
    extra = {} if dtype == "float32" else {"OMNISTAGE_INLINE_BYTES": "0"}
    plan = loopback_plan(tiny_model, dtype, extra)
    with LocalCluster(plan, log_dir=tmp_path_factory.mktemp(f"logs-{dtype}")) as cluster:
        yield cluster.coordinator, dtype


def generate_all(
    address: str,
    requests: dict[int, dict[str, object]],
    results: dict[int, object],
    denoising: threading.Semaphore | None = None,
    past_step: int = 1,
) -> list[threading.Thread]:
    """A thread per request (Client.events keyword arguments, the prompt among them), each
    putting its float image, or its error, in `results` under the request's key; `denoising`
    is released once per request when it has reported denoising step `past_step`."""

    def one(key: int, kwargs: dict[str, object]) -> None:
        with Client(address) as client:
            builder = ResultBuilder()
            released = False
            try:
                for event in client.events(**kwargs):  # type: ignore[arg-type]
                    if event.HasField("step") and event.step.step >= past_step and not released:
                        released = True
                        if denoising is not None:
                            denoising.release()
                    builder.add(event)
                results[key] = builder.build().tensor
            except OmniError as err:
                results[key] = err

    threads = [threading.Thread(target=one, args=item) for item in requests.items()]
    for thread in threads:
        thread.start()
    return threads


IMAGE_TOL = 1e-4  # batches differ between an uninterrupted and a resumed run: float rounding


def kill_mid_denoise(
    cluster: LocalCluster,
    requests: dict[int, dict[str, object]],
    victim: str = "dit-denoise",
    after_kill: Callable[[], None] = lambda: None,
    past_step: int = 1,
) -> str:
    """Run `requests` once uninterrupted, then again, killing `victim` with SIGKILL once every
    request has reported step `past_step` (then `after_kill()`); assert each resumed image
    equals its uninterrupted one. Returns the coordinator's log, to say where requests went."""
    expected: dict[int, object] = {}
    for thread in generate_all(cluster.coordinator, requests, expected):
        thread.join(120)
    results: dict[int, object] = {}
    denoising = threading.Semaphore(0)
    threads = generate_all(cluster.coordinator, requests, results, denoising, past_step)
    for _ in requests:
        assert denoising.acquire(timeout=120)
    assert not results, "the requests finished before the kill: make them longer"
    cluster.processes[victim].send_signal(signal.SIGKILL)
    after_kill()
    for thread in threads:
        thread.join(120)
    for key in requests:
        assert not isinstance(results[key], OmniError), (key, results[key])
        np.testing.assert_allclose(results[key], expected[key], atol=IMAGE_TOL, rtol=0)
    assert cluster.log_dir is not None
    return (cluster.log_dir / "coordinator.log").read_text()
