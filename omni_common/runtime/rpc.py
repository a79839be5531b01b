"""One place for gRPC channel and server settings, so every hop has the same bounded limits."""

from __future__ import annotations

import grpc
import grpc.aio

# Bulk tensors never travel in one message: they go by handle, or chunked (CHUNK_BYTES).
# The limit bounds what a peer can make us buffer; PNG results and raw chunks fit under it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024

_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def channel_options() -> list[tuple[str, int]]:
    """Options for every client channel."""
    return list(_OPTIONS)


def aio_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to `address` ("host:port") with our limits."""
    return grpc.aio.insecure_channel(address, options=channel_options())


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel to `address` with our limits."""
    return grpc.insecure_channel(address, options=channel_options())


def aio_server() -> grpc.aio.Server:
    """An asyncio server with our limits (no thread pool: handlers are coroutines)."""
    return grpc.aio.server(options=[*_OPTIONS, ("grpc.so_reuseport", 0)])
