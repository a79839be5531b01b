"""The coordinator's offload policy for stage replicas that share a device (`--offload swap`).

Replicas on one device (equal GPU UUID; on CPUs, equal host) take turns. Calls to one stage
form a phase: while it runs, calls of that stage join it, and calls of other stages queue;
when it has drained, the stage whose call has waited longest goes next. Before a phase
starts, the policy puts other replicas on the device to sleep until the new one's weights
fit the device's memory budget, then wakes it. Queued calls of a phase run together, so
one swap serves them all (the DiT batches them step by step).

The budget counts weights (StageInfo.weight_bytes), not activations: leave room for those.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc

from omnistage.v1 import stage_pb2
from services.coordinator.registry import Replica, ReplicaPool

log = logging.getLogger("omnistage.coordinator")

DEFAULT_BUDGET_SHARE = 0.9  # of the device's memory, when no budget is configured
CONTROL_TIMEOUT_S = 120.0  # a sleep or wake moves up to tens of GB


def device_key(info: stage_pb2.StageInfo) -> str:
    """Replicas with equal keys share one device's memory."""
    return f"gpu:{info.gpu_uuid}" if info.gpu_uuid else f"host:{info.host_id}"


class DeviceTurns:
    """One stage at a time on a device; the stage of the oldest waiting call goes next."""

    def __init__(self) -> None:
        self.stage: str | None = None
        self.active = 0
        self._waiting: list[tuple[int, str]] = []
        self._tickets = itertools.count()
        self._changed = asyncio.Condition()

    def _may_enter(self, ticket: tuple[int, str]) -> bool:
        number, stage = ticket
        older_other = any(s != stage for n, s in self._waiting if n < number)
        if stage == self.stage:
            return not older_other  # join the running phase unless another stage waits longer
        return self.active == 0 and self._waiting[0] == ticket

    async def enter(self, stage: str, switch: Callable[[], Awaitable[None]]) -> None:
        """Wait for `stage`'s turn; the first call of a new phase runs `switch` first."""
        async with self._changed:
            ticket = (next(self._tickets), stage)
            self._waiting.append(ticket)
            try:
                await self._changed.wait_for(lambda: self._may_enter(ticket))
            finally:
                self._waiting.remove(ticket)
                self._changed.notify_all()
            if self.stage != stage:
                # The lock is held: no call enters while the device changes hands.
                await switch()
                self.stage = stage
            self.active += 1

    async def leave(self) -> None:
        async with self._changed:
            self.active -= 1
            self._changed.notify_all()


class SwapPolicy:
    """Sleeps and wakes whole stages around their calls so they fit a device's budget."""

    def __init__(self, pool: ReplicaPool, budget_bytes: int = 0) -> None:
        self.pool = pool
        self.budget_bytes = budget_bytes  # 0: DEFAULT_BUDGET_SHARE of the device's memory
        self._turns: dict[str, DeviceTurns] = {}
        self._asleep: dict[str, bool] = {}  # by address; what the replica last told us

    @asynccontextmanager
    async def turn(self, replica: Replica) -> AsyncIterator[None]:
        """Hold `replica`'s device for one call."""
        if replica.info is None:
            yield
            return
        turns = self._turns.setdefault(device_key(replica.info), DeviceTurns())
        await turns.enter(replica.stage, lambda: self._make_room(replica))
        self._asleep[replica.address] = False  # a stage wakes by itself for a call
        try:
            yield
        finally:
            await turns.leave()

    def _is_asleep(self, replica: Replica) -> bool:
        assert replica.info is not None
        return self._asleep.get(replica.address, replica.info.asleep)

    def _budget(self, info: stage_pb2.StageInfo) -> int:
        return self.budget_bytes or int(info.device_memory_bytes * DEFAULT_BUDGET_SHARE)

    async def _make_room(self, replica: Replica) -> None:
        assert replica.info is not None
        key = device_key(replica.info)
        neighbours = [
            r
            for stage_replicas in self.pool.replicas.values()
            for r in stage_replicas
            if r is not replica and r.info is not None and device_key(r.info) == key
        ]
        neighbours = [r for r in neighbours if not self._is_asleep(r)]
        awake_bytes = sum(r.info.weight_bytes for r in neighbours if r.info is not None)
        budget = self._budget(replica.info)
        for other in neighbours:
            if awake_bytes + replica.info.weight_bytes <= budget:
                break
            assert other.info is not None
            if await self._control(other, "Sleep", stage_pb2.SleepRequest(level=1)):
                awake_bytes -= other.info.weight_bytes
        if self._is_asleep(replica):
            await self._control(replica, "Wake", stage_pb2.WakeRequest())

    async def _control(self, replica: Replica, method: str, request: object) -> bool:
        """Sleep or Wake `replica`; False when it refused (the call still goes ahead: a stage
        wakes by itself for a call, and a refused sleep only costs memory)."""
        if replica.control is None:
            return False
        try:
            done = await getattr(replica.control, method)(request, timeout=CONTROL_TIMEOUT_S)
        except grpc.RpcError as err:
            log.warning("%s of %s %s failed: %s", method, replica.stage, replica.address, err.details())
            return False
        self._asleep[replica.address] = not done.awake
        mb = done.bytes / 1e6
        log.info("%s %s %s: %.1f MB in %.3f s", method, replica.stage, replica.address, mb, done.seconds)
        return True
