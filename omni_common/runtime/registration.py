"""A stage replica's side of the control plane: heartbeats to the coordinator's Registry.

The first heartbeat registers the replica, later ones report its load; if the coordinator
restarts, the next heartbeat registers the replica again. A draining replica deregisters
so it gets no new work while it finishes what it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from omni_common.net.auth import cluster_metadata
from omni_common.net.rpc import aio_channel
from omnistage.v1 import coordinator_pb2_grpc, stage_pb2

log = logging.getLogger("omnistage.registration")

HEARTBEAT_S = 1.0


async def keep_registered(coordinator: str, info: Callable[[], stage_pb2.StageInfo]) -> None:
    """Heartbeat forever (cancel to stop); logs when the coordinator is lost and found."""
    stub = coordinator_pb2_grpc.RegistryStub(aio_channel(coordinator, metadata=cluster_metadata()))
    registered = False
    while True:
        period = HEARTBEAT_S
        try:
            reply = await stub.Heartbeat(info(), timeout=2.0)
            if not registered:
                log.info("registered with the coordinator at %s", coordinator)
                registered = True
            period = min(HEARTBEAT_S, reply.lease_ms / 3000) if reply.lease_ms else HEARTBEAT_S
        except grpc.RpcError as err:
            if registered:
                log.warning("lost the coordinator at %s (%s); retrying", coordinator, err.code().name)
            registered = False
        except Exception:
            # A heartbeat that dies silently makes the replica vanish from the coordinator
            # for good; whatever went wrong, say so and keep beating.
            log.exception("heartbeat to %s failed; retrying", coordinator)
            registered = False
        await asyncio.sleep(period)


async def deregister(coordinator: str, info: stage_pb2.StageInfo) -> None:
    try:
        await coordinator_pb2_grpc.RegistryStub(
            aio_channel(coordinator, metadata=cluster_metadata())
        ).Deregister(info, timeout=2.0)
    except grpc.RpcError as err:
        log.warning("could not deregister from %s: %s", coordinator, err.code().name)
