"""StageControl: the handle on a replica that is not a request: its device memory (sleep and
wake, driven by the coordinator's offload policy), its LoRA adapters (add, remove, list, pin),
new weights pushed while it serves (LoadWeights) and a profiler (start, stop).

The health service's AWAKE_SERVICE entry follows the memory state, so a probe or an operator
sees whether the weights are on the device. Every call maps omnistage's errors to their status;
anything else is INTERNAL, logged, and the replica keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from omni_common.errors import OmniError, abort
from omni_common.models.lora import LoraInfo
from omni_common.runtime.hot_reload import WeightsLoaded
from omni_common.runtime.memory import Transition
from omnistage.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("omnistage.stage")

AWAKE_SERVICE = "omnistage.awake"
T = TypeVar("T")


class ControlledWorker(Protocol):
    stage: str
    on_memory_change: Callable[[], Awaitable[None]] | None

    async def sleep(self, level: int) -> Transition: ...

    async def wake(self) -> Transition: ...

    @property
    def awake(self) -> bool: ...

    async def add_lora(self, name: str, path: str, scale: float, pinned: bool) -> LoraInfo: ...

    async def remove_lora(self, name: str) -> None: ...

    async def pin_lora(self, name: str, pinned: bool) -> LoraInfo: ...

    async def list_loras(self) -> tuple[list[LoraInfo], int, int]: ...

    async def load_weights(self, paths: Sequence[str]) -> WeightsLoaded: ...

    async def start_profile(self, name: str) -> Path: ...

    async def stop_profile(self) -> tuple[Path, float]: ...


def lora_message(info: LoraInfo) -> stage_pb2.LoraInfo:
    return stage_pb2.LoraInfo(
        name=info.name,
        source=info.source,
        scale=info.scale,
        rank=info.rank,
        modules=info.modules,
        bytes=info.nbytes,
        pinned=info.pinned,
        users=info.users,
    )


class StageControlServicer(stage_pb2_grpc.StageControlServicer):
    def __init__(self, worker: ControlledWorker, health_servicer: health.aio.HealthServicer) -> None:
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

    async def _do(self, what: str, work: Awaitable[T], context: grpc.aio.ServicerContext) -> T:
        """`work`'s result; its OmniError as the status, any other fault as INTERNAL."""
        try:
            return await work
        except OmniError as err:
            log.info("%s refused: %s", what, err.message)
            await abort(context, err)
            raise  # abort raises; this keeps type checkers aware
        except Exception:
            log.exception("%s failed", what)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"{what} failed in {self.worker.stage}; see its log"
            )
            raise

    async def _reply(self, done: Transition) -> stage_pb2.MemoryTransition:
        return stage_pb2.MemoryTransition(
            level=done.level, bytes=done.nbytes, seconds=done.seconds, awake=self.worker.awake
        )

    async def Sleep(
        self, request: stage_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.MemoryTransition:
        return await self._reply(await self._do("sleep", self.worker.sleep(request.level), context))

    async def Wake(
        self, request: stage_pb2.WakeRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.MemoryTransition:
        return await self._reply(await self._do("wake", self.worker.wake(), context))

    async def AddLora(
        self, request: stage_pb2.AddLoraRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.LoraInfo:
        scale = request.scale if request.HasField("scale") else 1.0
        work = self.worker.add_lora(request.name, request.path, scale, request.pinned)
        return lora_message(await self._do("AddLora", work, context))

    async def RemoveLora(
        self, request: stage_pb2.RemoveLoraRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.LoraList:
        await self._do("RemoveLora", self.worker.remove_lora(request.name), context)
        return await self.ListLoras(stage_pb2.ListLorasRequest(), context)

    async def ListLoras(
        self, request: stage_pb2.ListLorasRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.LoraList:
        loras, nbytes, max_bytes = await self._do("ListLoras", self.worker.list_loras(), context)
        return stage_pb2.LoraList(loras=[lora_message(i) for i in loras], bytes=nbytes, max_bytes=max_bytes)

    async def PinLora(
        self, request: stage_pb2.PinLoraRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.LoraInfo:
        return lora_message(
            await self._do("PinLora", self.worker.pin_lora(request.name, request.pinned), context)
        )

    async def LoadWeights(
        self, request: stage_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.LoadWeightsReply:
        done = await self._do("LoadWeights", self.worker.load_weights(list(request.paths)), context)
        return stage_pb2.LoadWeightsReply(tensors=done.tensors, bytes=done.nbytes, seconds=done.seconds)

    async def StartProfile(
        self, request: stage_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.ProfileReply:
        path = await self._do("StartProfile", self.worker.start_profile(request.name), context)
        return stage_pb2.ProfileReply(path=str(path))

    async def StopProfile(
        self, request: stage_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.ProfileReply:
        path, seconds = await self._do("StopProfile", self.worker.stop_profile(), context)
        return stage_pb2.ProfileReply(path=str(path), seconds=seconds)
