"""StageControl: the coordinator's handle on a replica's device memory (sleep and wake).

The health service's AWAKE_SERVICE entry follows the state, so a probe or an operator sees
whether the weights are on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2

from omni_common.errors import OmniError, abort
from omni_common.runtime.memory import Transition
from omnistage.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("omnistage.stage")

AWAKE_SERVICE = "omnistage.awake"


class SleepingWorker(Protocol):
    stage: str
    on_memory_change: Callable[[], Awaitable[None]] | None

    async def sleep(self, level: int) -> Transition: ...

    async def wake(self) -> Transition: ...

    @property
    def awake(self) -> bool: ...


class StageControlServicer(stage_pb2_grpc.StageControlServicer):
    def __init__(self, worker: SleepingWorker, health_servicer: health.aio.HealthServicer) -> None:
        self.worker = worker
        self.health = health_servicer
        worker.on_memory_change = self.publish  # a stage also wakes by itself for a call

    async def publish(self) -> None:
        """Set the health entry from the worker's state."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.worker.awake
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(AWAKE_SERVICE, status)

    async def _reply(self, done: Transition) -> stage_pb2.MemoryTransition:
        return stage_pb2.MemoryTransition(
            level=done.level, bytes=done.nbytes, seconds=done.seconds, awake=self.worker.awake
        )

    async def Sleep(
        self, request: stage_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.MemoryTransition:
        try:
            return await self._reply(await self.worker.sleep(request.level))
        except OmniError as err:
            log.info("sleep refused: %s", err.message)
            await abort(context, err)
            raise  # abort raises; this keeps type checkers aware

    async def Wake(
        self, request: stage_pb2.WakeRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.MemoryTransition:
        return await self._reply(await self.worker.wake())
