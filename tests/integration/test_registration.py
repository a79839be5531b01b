"""A replica's heartbeats against a real Registry on loopback: an error while building one
heartbeat must not end them (the replica would vanish from routing for good)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from omni_common.net.rpc import aio_server
from omni_common.runtime.registration import keep_registered
from omnistage.v1 import coordinator_pb2_grpc, stage_pb2
from services.coordinator.registry import RegistryServicer, ReplicaPool


async def _registry() -> tuple[grpc.aio.Server, ReplicaPool, str]:
    pool = ReplicaPool()
    server = aio_server()
    coordinator_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, pool, f"127.0.0.1:{port}"


def test_heartbeats_go_on_after_a_heartbeat_failed_to_build(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        server, pool, address = await _registry()
        calls = 0

        def info() -> stage_pb2.StageInfo:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("the load signal is not ready yet")
            return stage_pb2.StageInfo(
                stage="dit-denoise", address="127.0.0.1:1", model="m", family="qwenimage"
            )

        task = asyncio.create_task(keep_registered(address, info))
        try:
            for _ in range(50):  # the second heartbeat comes a second after the first
                if pool.find("dit-denoise", "127.0.0.1:1") is not None:
                    break
                await asyncio.sleep(0.1)
            assert pool.find("dit-denoise", "127.0.0.1:1") is not None
        finally:
            task.cancel()
            await server.stop(None)

    with caplog.at_level(logging.ERROR, "omnistage.registration"):
        asyncio.run(scenario())
    assert "heartbeat to" in caplog.text and "the load signal is not ready yet" in caplog.text


def test_a_probe_finds_a_registered_replica_that_died_before_its_lease_ran_out() -> None:
    """What the coordinator asks when a consumer cannot read a producer's output: a replica
    killed a moment ago still counts as alive by its heartbeat lease; the probe finds it dead."""
    from omni_common.cluster import free_port

    async def scenario() -> None:
        pool = ReplicaPool()
        address = f"127.0.0.1:{free_port()}"  # nothing listens there: the replica is gone
        pool.register(
            stage_pb2.StageInfo(stage="dit-denoise", address=address, model="m", family="qwenimage")
        )
        assert pool.is_alive(address)
        assert not await pool.probe(address)
        assert not pool.is_alive(address)
        assert not await pool.probe("127.0.0.1:1")  # an unknown address is no live producer

    asyncio.run(scenario())
