"""One place for gRPC channel and server settings, so every hop has the same bounded limits."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from omni_common.net import tracing
from omni_common.net.tls import TlsSettings, channel_credentials, channel_name_options, client_settings

# Bulk tensors never travel in one message: they go by handle, or chunked (CHUNK_BYTES).
# The limit bounds what a peer can make us buffer; PNG results and raw chunks fit under it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024

# Both ends ping an idle connection every KEEPALIVE_MS to notice a dead peer. A server answers
# pings that come more often than it allows with GOAWAY "too_many_pings", which fails every
# call on the connection (a request queued behind fifty others sees no data for a while), so
# servers accept pings at twice the rate clients send them.
KEEPALIVE_MS = 30_000


def channel_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """Options for every client channel."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """Options for every server: our limits, and the pings our channels send are welcome."""
    return [
        *channel_options(keepalive_ms),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
    ]


Metadata = tuple[tuple[str, str], ...]


class _AddsMetadata:
    """Adds metadata to every call of an asyncio channel: fixed entries (a credential) and
    what `more()` gives at call time (the caller's trace context)."""

    def __init__(self, metadata: Metadata, more: Callable[[], Metadata] | None = None) -> None:
        self.metadata = metadata
        self.more = more

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        added = (*self.metadata, *(self.more() if self.more is not None else ()))
        if not added:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *added)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files an interceptor under the first call kind it implements: one class per kind.
class _UnaryUnary(_AddsMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with(details), request)


class _UnaryStream(_AddsMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with(details), request)


class _StreamUnary(_AddsMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):
        return await continuation(self._with(details), requests)


class _StreamStream(_AddsMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):
        return await continuation(self._with(details), requests)


class _SendMetadataSync(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The blocking channels' _SendMetadata (the SDK's calls are unary or server-streaming)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def _with(self, details):
        return details._replace(metadata=[*(details.metadata or ()), *self.metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with(details), request)


def aio_channel(
    address: str, keepalive_ms: int = KEEPALIVE_MS, metadata: Metadata = (), tls: TlsSettings | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to `address` ("host:port") with our limits; `metadata` goes with
    every call (omni_common.net.auth: the cluster token, an API key). It verifies TLS
    against `tls` (default: this process's OMNISTAGE_TLS_CA), plaintext without a CA."""
    tls = tls or client_settings()
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    more = tracing.context_metadata if tracing.enabled() else None  # nothing while tracing is off
    interceptors = [kind(metadata, more) for kind in kinds] if metadata or more else []
    options = [*channel_options(keepalive_ms), *channel_name_options(tls)]
    credentials = channel_credentials(tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors or None)


def sync_channel(address: str, metadata: Metadata = (), tls: TlsSettings | None = None) -> grpc.Channel:
    """A blocking channel to `address` with our limits, `metadata` with every call, TLS as
    in aio_channel."""
    tls = tls or client_settings()
    options = [*channel_options(), *channel_name_options(tls)]
    credentials = channel_credentials(tls)
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    return grpc.intercept_channel(channel, _SendMetadataSync(metadata)) if metadata else channel


class _Malformed:
    """What a request that is not a valid protobuf message decodes to (DecodeGuard)."""


MALFORMED = _Malformed()


class DecodeGuard(grpc.aio.ServerInterceptor):
    """A request whose bytes are not a valid message of its type gets INVALID_ARGUMENT, not
    grpc's UNKNOWN carrying a parser's class name: the deserializer marks it, the handler
    refuses it before the servicer sees it (unary requests: every RPC of ours)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> object:
            try:
                return parse(data)
            except DecodeError:
                return MALFORMED

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{details.method}: the request is not a valid message"
            )

        if handler.response_streaming:
            serve_stream = handler.unary_stream

            async def stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
                if request is MALFORMED:
                    await refuse(context)
                result = serve_stream(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:  # a handler that writes through the context
                    await result

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=deserialize, response_serializer=handler.response_serializer
            )
        serve_unary = handler.unary_unary

        async def unary(request: object, context: grpc.aio.ServicerContext) -> object:
            if request is MALFORMED:
                await refuse(context)
            return await serve_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserialize, response_serializer=handler.response_serializer
        )


def aio_server(
    keepalive_ms: int = KEEPALIVE_MS, interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
) -> grpc.aio.Server:
    """An asyncio server with our limits (no thread pool: handlers are coroutines); malformed
    requests are refused cleanly (DecodeGuard), after `interceptors` (access control)."""
    traced = tracing.server_interceptors()  # a span per traced call; none when tracing is off
    return grpc.aio.server(
        options=server_options(keepalive_ms), interceptors=(*traced, *interceptors, DecodeGuard())
    )
