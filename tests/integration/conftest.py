"""An in-process cluster: real grpc.aio servers on loopback (three stages and the
coordinator) on one event loop in a background thread, with real shared memory."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omni_common.runtime.config import CoordinatorConfig, StageConfig
from omni_common.runtime.stage_service import serve_stage
from omni_common.transport import TensorTransport
from services.ar_encoder.worker import EncoderWorker
from services.coordinator.server import serve_coordinator
from services.dit_denoise.server import make_worker as make_denoise_worker
from services.vae_decode.worker import DecodeWorker

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

WORKERS = {"ar-encoder": EncoderWorker, "dit-denoise": make_denoise_worker, "vae-decode": DecodeWorker}


@dataclass
class InProcessCluster:
    model_dir: Path
    dtype: str = "float32"
    # Extra StageConfig fields per stage, e.g. {"dit-denoise": {"max_queue": 1}}.
    stage_options: dict[str, dict[str, object]] = field(default_factory=dict)
    coordinator_options: dict[str, object] = field(default_factory=dict)
    # More replicas of a stage, by name ("ar-encoder.2"), each with its StageConfig fields over
    # its stage's. Any replica can be stopped alone (stop_replica).
    extra_replicas: dict[str, dict[str, object]] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    transports: dict[str, TensorTransport] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def coordinator(self) -> str:
        return self.addresses["coordinator"]

    def start(self) -> None:
        self._thread.start()
        self._tasks = []
        self._replica_stops: dict[str, asyncio.Event] = {}
        for name in [*WORKERS, *self.extra_replicas]:
            stage = name.split(".")[0]
            options = {**self.stage_options.get(stage, {}), **self.extra_replicas.get(name, {})}
            config = StageConfig(stage=stage, model_dir=self.model_dir, dtype=self.dtype, port=0, **options)  # type: ignore[arg-type]
            # A low inline threshold sends every hop but the smallest through shared memory.
            transport = self.transports[name] = TensorTransport(inline_threshold=1024)
            self._launch(
                name,
                serve_stage(
                    config,
                    WORKERS[stage],
                    ready=self._ready(name),
                    stop=self._replica_stop(name),
                    transport=transport,
                ),
            )
        replicas = {stage: [self.addresses[stage]] for stage in WORKERS}
        for name in self.extra_replicas:
            replicas[name.split(".")[0]].append(self.addresses[name])
        config = CoordinatorConfig(replicas=replicas, port=0, **self.coordinator_options)  # type: ignore[arg-type]
        transport = self.transports["coordinator"] = TensorTransport()
        self._launch(
            "coordinator",
            serve_coordinator(config, ready=self._ready("coordinator"), stop=self._stop, transport=transport),
        )

    def _replica_stop(self, name: str) -> asyncio.Event:
        """A replica's own stop event; the cluster's stop sets it too."""
        stop = self._replica_stops[name] = asyncio.Event()

        async def follow() -> None:
            await self._stop.wait()
            stop.set()

        asyncio.run_coroutine_threadsafe(follow(), self.loop)
        return stop

    def drain_replica(self, name: str) -> None:
        """Start one replica's drain, as SIGTERM does, and return (stop_replica waits for its end)."""
        self.loop.call_soon_threadsafe(self._replica_stops[name].set)

    def stop_replica(self, name: str) -> None:
        """Stop one replica (its server and its shared memory) and wait until it is down."""
        self.drain_replica(name)
        self._tasks[[*WORKERS, *self.extra_replicas].index(name)].result(60)

    def live_leases(self) -> dict[str, int]:
        return {name: t.live_leases() for name, t in self.transports.items()}

    def _ready(self, name: str):
        event = threading.Event()
        self._events = getattr(self, "_events", {})
        self._events[name] = event

        def mark(address: str) -> None:
            self.addresses[name] = address
            event.set()

        return mark

    def _launch(self, name: str, coro) -> None:
        task = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._tasks.append(task)
        while not self._events[name].wait(0.1):
            if task.done():
                task.result()  # raises the start-up error
            if not self._thread.is_alive():  # a SystemExit (a port in use) ends the loop itself
                raise RuntimeError(f"{name} did not start: the cluster's loop ended (its error is above)")
        assert name in self.addresses

    def metrics(self, name: str) -> Samples:
        """One scrape of the metrics of `name` ("coordinator" or a stage), at the metrics_port
        its options gave (choose it when the cluster starts: a port picked at import may be
        another's by then)."""
        options = self.coordinator_options if name == "coordinator" else self.stage_options[name]
        return scrape(cast(int, options["metrics_port"]))

    def call(self, coro):
        """Run a coroutine on the cluster's loop (to reach its objects) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        for task in self._tasks:
            task.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(tiny_model)
    running.start()
    yield running
    running.stop()


def scrape(port: int) -> Samples:
    """One scrape, parsed by prometheus_client's own parser of the text format."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class InProcessGateway:
    """The HTTP gateway (services/gateway) on a cluster's event loop, on a free loopback port."""

    def __init__(self, loop: asyncio.AbstractEventLoop, coordinator: str, **options: object) -> None:
        from omni_common.runtime.config import GatewayConfig
        from services.gateway.server import serve_gateway

        self.loop = loop
        self.url = ""
        started = threading.Event()
        self._stop = asyncio.Event()

        def mark(url: str) -> None:
            self.url = url
            started.set()

        config = GatewayConfig(coordinator=coordinator, port=0, **options)  # type: ignore[arg-type]
        self._task = asyncio.run_coroutine_threadsafe(
            serve_gateway(config, ready=mark, stop=self._stop, grace_s=5.0), loop
        )
        while not started.wait(0.1):
            if self._task.done():
                self._task.result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._task.result(30)
