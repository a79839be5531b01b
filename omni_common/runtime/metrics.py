"""Prometheus metrics of one service, served as text over plain HTTP from its own event loop.

Every stage replica and the coordinator expose `GET /metrics` on `--metrics-port`
(OMNISTAGE_METRICS_PORT; 0 = off). Gauges are read when scraped, on the event-loop thread
that also owns the worker's state, so a scrape sees exactly the numbers the replica
heartbeats (StageInfo.load) and needs no lock. A scrape never waits for a model forward:
forwards run on the worker's compute thread. In Kubernetes, prometheus-adapter turns
`omnistage_stage_load` into the custom metric each stage's HorizontalPodAutoscaler follows
(deploy/k8s/).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from omni_common.stages import STAGES

if TYPE_CHECKING:  # (the step scheduler brings torch, which a service without a model lacks)
    from omni_common.runtime.step_scheduler import StepTotals

# A scraper that sends no complete request head in this time is dropped.
READ_TIMEOUT_S = 5.0
# Scrapers send a request line and a few headers; anything larger is not one.
MAX_HEAD_BYTES = 16 * 1024


class RequestOutcomes:
    """Finished requests: `<prefix>_requests_<success>_total` and, by gRPC status code,
    `<prefix>_requests_failed_total`."""

    def __init__(
        self, registry: CollectorRegistry, prefix: str, success: str, labels: dict[str, str]
    ) -> None:
        names = list(labels)
        ok = Counter(
            f"{prefix}_requests_{success}", "Requests that ended with status OK", names, registry=registry
        )
        self._ok = ok.labels(**labels) if labels else ok
        self._failed = Counter(
            f"{prefix}_requests_failed",
            "Requests that ended with an error status (CANCELLED included), by gRPC status code",
            [*names, "code"],
            registry=registry,
        )
        self._labels = labels

    def finished(self, code: grpc.StatusCode) -> None:
        if code == grpc.StatusCode.OK:
            self._ok.inc()
        else:
            self._failed.labels(**self._labels, code=code.name).inc()


class StageMetrics:
    """Metrics of one stage replica, labelled with its stage."""

    def __init__(
        self,
        stage: str,
        load: Callable[[], int],
        in_flight: Callable[[], int],
        steps: Callable[[], Mapping[str, StepTotals]] = dict,
    ) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "omnistage_stage_load",
            "The stage's own load signal, as heartbeated in StageInfo.load: pending prompts "
            "(ar-encoder), remaining denoise steps x image tokens (dit-denoise), pending pixels "
            "(vae-decode)",
            ["stage"],
            registry=self.registry,
        ).labels(stage=stage).set_function(load)
        Gauge(
            "omnistage_stage_in_flight",
            "Stage.Run calls waiting or running on this replica (StageInfo.queue_depth)",
            ["stage"],
            registry=self.registry,
        ).labels(stage=stage).set_function(in_flight)
        self.requests = RequestOutcomes(self.registry, "omnistage_stage", "served", {"stage": stage})
        self.feeds = Counter(
            "omnistage_stage_feeds",
            "Stage.Feed calls taken (input chunks of streaming calls, one RPC each), by role",
            ["stage", "role"],
            registry=self.registry,
        )
        self._stage = stage
        self._steps(stage, steps)

    def fed(self, role: str) -> None:
        """One Feed call for `role` (a role this replica serves) was taken."""
        self.feeds.labels(stage=self._stage, role=role).inc()

    def _steps(self, stage: str, steps: Callable[[], Mapping[str, StepTotals]]) -> None:
        """Step-wise roles: steps run, device time in them and device idle time between them
        (the time a step costs outside its forward: host work the device waited for)."""
        series = (
            ("omnistage_steps", "Steps run (one per batch forward)", "steps"),
            ("omnistage_step_device_seconds", "Device time inside steps (CUDA events)", "device_s"),
            (
                "omnistage_step_idle_seconds",
                "Device idle time between two steps of a running request",
                "idle_s",
            ),
            (
                "omnistage_idle_work_left",
                "Work the role does while no request is here, still to do (dit-denoise: CUDA "
                "graphs of common prompt lengths to capture)",
                "idle_work_left",
            ),
            (
                "omnistage_prefix_cache_hits",
                "Prompts whose prefix KV (an earlier turn of the conversation) was reused",
                "prefix_hits",
            ),
            ("omnistage_prefix_cache_misses", "Prompts that found no prefix KV to reuse", "prefix_misses"),
            ("omnistage_prefix_cache_bytes", "Bytes of prefix KV kept for later prompts", "prefix_bytes"),
        )
        for name, doc, attr in series:
            gauge = Gauge(name, doc, ["stage", "role"], registry=self.registry)
            for role in steps():
                gauge.labels(stage=stage, role=role).set_function(
                    functools.partial(_step_total, steps, role, attr)
                )
        self.registry.register(PrefillChunks(stage, steps))


class PrefillChunks(Collector):
    """`omnistage_prefill_chunks_total`, a counter read when scraped: the prefill chunks each
    role ran a step at a time (prompts longer than --prefill-chunk-tokens)."""

    def __init__(self, stage: str, steps: Callable[[], Mapping[str, StepTotals]]) -> None:
        self.stage = stage
        self.steps = steps

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "omnistage_prefill_chunks",
            "Prompt chunks prefilled between decode steps (prompts longer than --prefill-chunk-tokens)",
            labels=["stage", "role"],
        )
        for role, totals in self.steps().items():
            family.add_metric([self.stage, role], totals.prefill_chunks)
        yield family


class CoordinatorMetrics:
    """Metrics of the coordinator: requests and the replicas it can route to."""

    def __init__(self, in_flight: Callable[[], int], replicas: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "omnistage_coordinator_requests_in_flight",
            "Generate requests accepted and not yet finished",
            registry=self.registry,
        ).set_function(in_flight)
        healthy = Gauge(
            "omnistage_coordinator_replicas",
            "Healthy replicas per stage (registered by heartbeat or configured statically)",
            ["stage"],
            registry=self.registry,
        )
        for stage in STAGES:
            healthy.labels(stage=stage).set_function(functools.partial(_count, replicas, stage))
        self.requests = RequestOutcomes(self.registry, "omnistage_coordinator", "completed", {})


class GatewayMetrics:
    """Metrics of the HTTP gateway, served at its own GET /metrics: requests by route and
    HTTP status, their duration (a stream's until its last event), requests in flight."""

    def __init__(self, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        Gauge(
            "omnistage_gateway_requests_in_flight",
            "Generation requests being served (streams until their last event)",
            registry=self.registry,
        ).set_function(in_flight)
        self._requests = Counter(
            "omnistage_gateway_requests",
            "HTTP requests answered, by route and HTTP status",
            ["route", "status"],
            registry=self.registry,
        )
        self._seconds = Histogram(
            "omnistage_gateway_request_seconds",
            "Time from a request's arrival to its response's end, by route",
            ["route"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )

    def answered(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route=route, status=str(status)).inc()
        self._seconds.labels(route=route).observe(seconds)

    def text(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _step_total(steps: Callable[[], Mapping[str, StepTotals]], role: str, attr: str) -> float:
    return float(getattr(steps()[role], attr))


def _count(counts: Callable[[], dict[str, int]], key: str) -> int:
    return counts().get(key, 0)


def _response(head: bytes, registry: CollectorRegistry) -> bytes:
    """The whole HTTP/1.1 response to one request head."""
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    method = request_line[0]
    path = request_line[1].split("?", 1)[0] if len(request_line) > 1 else ""
    status, content_type, body, extra = "200 OK", CONTENT_TYPE_LATEST, b"", ""
    if path != "/metrics":
        status, content_type, body = "404 Not Found", "text/plain", b"metrics are at /metrics\n"
    elif method not in ("GET", "HEAD"):
        status, content_type, extra = "405 Method Not Allowed", "text/plain", "Allow: GET, HEAD\r\n"
    else:
        body = generate_latest(registry)
    header = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return header.encode("latin-1") + (b"" if method == "HEAD" else body)


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """Serve `registry` at http://host:port/metrics on the running loop, one request per
    connection (each answer closes it; a scraper reconnects every interval, cheap next to
    the interval). Raises OSError when the port cannot be bound."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            writer.write(_response(head, registry))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away or never spoke HTTP: nothing to answer
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_HEAD_BYTES, reuse_address=True)
