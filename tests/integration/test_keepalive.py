"""A call that sees no data for longer than the keepalive interval survives our own pings
(a server that wants them further apart would end it with GOAWAY "too_many_pings")."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omni_common.net.rpc import aio_channel, aio_server

KEEPALIVE_MS = 500


def test_a_quiet_stream_outlives_many_keepalive_pings() -> None:
    async def main() -> grpc.StatusCode | None:
        server = aio_server(KEEPALIVE_MS)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}", KEEPALIVE_MS) as channel:
                # Watch sends the status once, then nothing while it stays the same.
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                try:
                    async with asyncio.timeout(KEEPALIVE_MS * 10 / 1000):
                        async for _ in call:
                            pass
                except TimeoutError:
                    return None
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK  # the stream must not end by itself
        finally:
            await server.stop(None)

    assert asyncio.run(main()) is None
