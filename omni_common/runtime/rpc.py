"""One place for gRPC channel and server settings, so every hop has the same bounded limits."""

from __future__ import annotations

import grpc
import grpc.aio

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


def aio_channel(address: str, keepalive_ms: int = KEEPALIVE_MS) -> grpc.aio.Channel:
    """An asyncio channel to `address` ("host:port") with our limits."""
    return grpc.aio.insecure_channel(address, options=channel_options(keepalive_ms))


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel to `address` with our limits."""
    return grpc.insecure_channel(address, options=channel_options())


def aio_server(keepalive_ms: int = KEEPALIVE_MS) -> grpc.aio.Server:
    """An asyncio server with our limits (no thread pool: handlers are coroutines)."""
    return grpc.aio.server(options=server_options(keepalive_ms))
