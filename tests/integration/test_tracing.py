"""Traces across the services: one request through the gateway is one trace, gateway →
coordinator → each stage, with a span per plan step (the hop to a stage) and the wait in a
stage's queue; collected in memory from a real in-process cluster. And every service answers
gRPC server reflection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from omni_common.client import Client
from omni_common.net import tracing
from omni_common.net.rpc import sync_channel

from .conftest import InProcessCluster, InProcessGateway

STAGE_RUN = "omnistage.v1.Stage/Run"


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install("omnistage-test", SimpleSpanProcessor(exporter))
    try:
        yield exporter
    finally:
        tracing.uninstall()


@pytest.fixture(scope="module")
def traced(
    tiny_model: Path, spans: InMemorySpanExporter
) -> Iterator[tuple[InProcessCluster, InProcessGateway]]:
    # Servers and channels made while tracing is on carry traces.
    cluster = InProcessCluster(tiny_model)
    cluster.start()
    gateway = InProcessGateway(cluster.loop, cluster.coordinator)
    yield cluster, gateway
    gateway.stop()
    cluster.stop()


def test_one_request_is_one_trace_from_the_gateway_through_every_stage(traced, spans) -> None:
    _, gateway = traced
    spans.clear()
    body = {"prompt": "a cat", "size": "32x32", "num_inference_steps": 3, "seed": 3}
    response = httpx.post(f"{gateway.url}/v1/images/generations", json=body, timeout=60)
    assert response.status_code == 200
    finished = list(spans.get_finished_spans())
    (root,) = [s for s in finished if s.name == "POST /v1/images/generations"]
    assert root.parent is None and root.kind == SpanKind.SERVER
    trace = [s for s in finished if s.context.trace_id == root.context.trace_id]
    by_id = {s.context.span_id: s for s in trace}

    def children(span, name: str):
        return [
            s
            for s in trace
            if s.parent is not None and s.parent.span_id == span.context.span_id and s.name == name
        ]

    (generate,) = children(root, "omnistage.v1.Coordinator/Generate")
    assert generate.kind == SpanKind.SERVER
    steps = {s.attributes["omnistage.stage"]: s for s in trace if s.name.startswith("step ")}
    assert set(steps) == {"ar-encoder", "dit-denoise", "vae-decode"}
    for stage, step in steps.items():
        # Each plan step is a child of the request (maybe through other steps' spans: a step
        # is produced on demand by the one that consumes it) ...
        ancestor = step
        while ancestor.parent is not None and ancestor.name != "omnistage.v1.Coordinator/Generate":
            ancestor = by_id[ancestor.parent.span_id]
        assert ancestor is generate, stage
        # ... and the hop to the stage: the stage's own server span is the step's child.
        (run,) = children(step, STAGE_RUN)
        assert run.kind == SpanKind.SERVER
        assert step.start_time <= run.start_time and run.end_time <= step.end_time
    # Each stage queues a request (for a batch, for its first step): the wait is a span.
    for stage in ("ar-encoder", "dit-denoise", "vae-decode"):
        (run,) = children(steps[stage], STAGE_RUN)
        (wait,) = children(run, "queue wait")
        assert wait.end_time <= run.end_time
    # Nothing of the request leaked into another trace.
    assert not [s for s in finished if s.name == STAGE_RUN and s.context.trace_id != root.context.trace_id]


def test_a_direct_sdk_request_starts_its_trace_at_the_coordinator(traced, spans) -> None:
    cluster, _ = traced
    spans.clear()
    with Client(cluster.coordinator) as client:
        client.generate("a cat", width=16, height=16, steps=2)
    finished = list(spans.get_finished_spans())
    (root,) = [s for s in finished if s.parent is None]
    assert root.name == "omnistage.v1.Coordinator/Generate"
    runs = [s for s in finished if s.name == STAGE_RUN]
    assert len(runs) == 3 and all(s.context.trace_id == root.context.trace_id for s in runs)
    # Health checks and heartbeats start no traces.
    assert not [s for s in finished if "Health" in s.name or "Registry" in s.name]


def test_every_service_answers_grpc_reflection(traced) -> None:
    cluster, _ = traced
    expected = {
        "coordinator": {"omnistage.v1.Coordinator", "omnistage.v1.Registry", "omnistage.v1.TensorStore"},
        "ar-encoder": {"omnistage.v1.Stage", "omnistage.v1.StageControl", "omnistage.v1.TensorStore"},
    }
    expected["dit-denoise"] = expected["vae-decode"] = expected["ar-encoder"]
    for name, address in cluster.addresses.items():
        with sync_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (answer,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
            listed = {s.name for s in answer.list_services_response.service}
            assert expected[name] | {"grpc.health.v1.Health"} <= listed, name
            # A service's schema comes with it: what grpcurl needs to call it.
            request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=sorted(expected[name])[0])
            (answer,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
            assert answer.file_descriptor_response.file_descriptor_proto, name


def test_an_http_callers_trace_context_is_the_gateways_parent(traced, spans) -> None:
    _, gateway = traced
    spans.clear()
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = {"prompt": "a cat", "size": "16x16", "num_inference_steps": 2}
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    response = httpx.post(f"{gateway.url}/v1/images/generations", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    finished = list(spans.get_finished_spans())
    (root,) = [s for s in finished if s.name == "POST /v1/images/generations"]
    assert root.parent is not None and format(root.parent.span_id, "016x") == parent_id
    assert format(root.context.trace_id, "032x") == trace_id
    runs = [s for s in finished if s.name == STAGE_RUN]
    assert len(runs) == 3 and {format(s.context.trace_id, "032x") for s in runs} == {trace_id}
