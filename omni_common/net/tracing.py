"""OpenTelemetry traces across the services: one trace per request, gateway → coordinator →
each stage, its context carried in gRPC metadata (W3C `traceparent`).

Off unless OTEL_EXPORTER_OTLP_ENDPOINT is set (OTLP over gRPC, or HTTP with
OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf; OTEL_SERVICE_NAME overrides the service name):
off, no interceptor is installed, `span` yields a do-nothing object and the SDK is never
imported, so tracing costs nothing. On:
- every server (rpc.aio_server) opens a SERVER span per call that carries a trace context,
  and per public (Coordinator) call, named after the method;
- every asyncio channel (rpc.aio_channel) sends the caller's current context;
- the code opens spans where time goes: the gateway's request, each plan step and a wait for
  a replica (coordinator), a request's wait in a stage's queue (batching.py).
Health checks, heartbeats and other calls outside a request start no trace.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import grpc
import grpc.aio

TRACEPARENT = "traceparent"
# Calls traced without an incoming context: the public API, where requests start.
ROOT_SERVICES = ("/omnistage.v1.Coordinator/",)

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None


class _NoSpan:
    """What `span` yields while tracing is off."""

    def set_attribute(self, key: str, value: object) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN = _NoSpan()


def enabled() -> bool:
    return _tracer is not None


def setup(service: str) -> None:
    """At a process's start: export spans by OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    install(
        os.environ.get("OTEL_SERVICE_NAME", f"omnistage-{service}"), BatchSpanProcessor(OTLPSpanExporter())
    )


def install(service: str, processor: Any) -> None:
    """Turn tracing on in this process with a span processor (tests: a SimpleSpanProcessor
    over an InMemorySpanExporter). Servers and channels made afterwards carry traces."""
    global _tracer, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer("omnistage")


def uninstall() -> None:
    """Turn tracing off again (flushing what is buffered)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def _kind(name: str) -> Any:
    from opentelemetry.trace import SpanKind

    return {"server": SpanKind.SERVER, "client": SpanKind.CLIENT}.get(name, SpanKind.INTERNAL)


@contextlib.contextmanager
def span(name: str, kind: str = "internal", **attributes: str | int | float | bool) -> Iterator[Any]:
    """A span around the block, a child of the current one (the current one inside it)."""
    if _tracer is None:
        yield NO_SPAN
        return
    with _tracer.start_as_current_span(name, kind=_kind(kind), attributes=attributes) as current:
        yield current


def start(
    name: str,
    kind: str = "internal",
    carrier: Mapping[str, str] | None = None,
    attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Any:
    """A span that starts now and ends when its `end()` is called, from any task (a wait
    that another task ends, a streamed response): a child of the context in `carrier` (an
    HTTP request's headers: W3C `traceparent`) when given, else of the current span."""
    if _tracer is None:
        return NO_SPAN
    parent = None
    if carrier is not None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier)
    return _tracer.start_span(name, context=parent, kind=_kind(kind), attributes=attributes)


@contextlib.contextmanager
def current(started: Any) -> Iterator[None]:
    """Make a span from `start` the current one inside the block (without ending it)."""
    if _tracer is None or started is NO_SPAN:
        yield
        return
    from opentelemetry.trace import use_span

    with use_span(started, end_on_exit=False):
        yield


def _metadata_carrier(metadata: Any) -> dict[str, str]:
    return {key: value for key, value in metadata or () if isinstance(value, str)}


class _ServerSpans(grpc.aio.ServerInterceptor):
    """A SERVER span per call that carries a trace context or enters the public API."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        carrier = _metadata_carrier(details.invocation_metadata)
        method = details.method
        if (
            handler is None
            or handler.request_streaming
            or not (TRACEPARENT in carrier or method.startswith(ROOT_SERVICES))
        ):
            return handler
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier)
        name = method.lstrip("/")
        kind = _kind("server")
        if handler.response_streaming:
            serve_stream = handler.unary_stream

            async def stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                with _tracer.start_as_current_span(name, context=parent, kind=kind):
                    result = serve_stream(request, context)
                    if inspect.isasyncgen(result):
                        async for item in result:
                            yield item
                    else:
                        await result

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        serve_unary = handler.unary_unary

        async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
            with _tracer.start_as_current_span(name, context=parent, kind=kind):
                return await serve_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def server_interceptors() -> tuple[grpc.aio.ServerInterceptor, ...]:
    """For rpc.aio_server: the span interceptor while tracing is on, nothing otherwise."""
    return (_ServerSpans(),) if _tracer is not None else ()


def context_metadata() -> tuple[tuple[str, str], ...]:
    """The caller's current trace context as call metadata (rpc.aio_channel sends it while
    tracing is on); empty outside a span."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return tuple(carrier.items())
