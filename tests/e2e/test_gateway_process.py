"""`omnistage serve gateway` as a real process: it says where it listens (port 0 works),
answers health, and SIGTERM stops it cleanly through its drain (exit status 0); with
OTEL_EXPORTER_OTLP_ENDPOINT set it exports its spans by OTLP to a collector."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from omni_common.cluster import free_port

pytestmark = pytest.mark.slow


def start_gateway(extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """The gateway process and its URL, once it said it is ready."""
    env = {
        **os.environ,
        "OMNISTAGE_PORT": "0",
        # No coordinator there: the gateway itself still starts and is healthy.
        "OMNISTAGE_COORDINATOR": f"127.0.0.1:{free_port()}",
        **(extra_env or {}),
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "omnistage_cli", "serve", "gateway"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert gateway.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = gateway.stdout.readline()
        lines.append(line)
        if line.startswith("gateway ready on ") or gateway.poll() is not None:
            break
    if not lines[-1].startswith("gateway ready on "):
        gateway.kill()
        gateway.wait()
        raise AssertionError("".join(lines))
    return gateway, "http://" + lines[-1].split()[-1]


def test_serve_gateway_starts_answers_health_and_stops_on_sigterm() -> None:
    gateway, url = start_gateway()
    try:
        assert gateway.stdout is not None
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat"}, timeout=30)
        assert response.status_code == 503  # nothing at the coordinator's address
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(30) == 0
        rest = gateway.stdout.read()
        assert "gateway stopped" in rest, rest
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []  # (service.name, span name)

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(
                a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"
            )
            for scope in resource_spans.scope_spans:
                self.spans.extend((service, span.name) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_with_an_otlp_endpoint_the_gateways_spans_reach_the_collector() -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        gateway, url = start_gateway(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        )
        try:
            response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat"}, timeout=30)
            assert response.status_code == 503
            gateway.send_signal(signal.SIGTERM)  # spans still buffered are sent at exit
            assert gateway.wait(30) == 0
        finally:
            if gateway.poll() is None:
                gateway.kill()
                gateway.wait()
        assert ("omnistage-gateway", "POST /v1/images/generations") in collector.spans
    finally:
        server.stop(None)
