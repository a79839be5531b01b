"""Stage replicas known to the coordinator and how one is picked for a request.

Addresses come from configuration (several per stage, round robin over the healthy ones).
Each replica describes itself through Stage.Info (model, host id, device), which decides
the transport of every hop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import grpc

from omni_common.errors import InvalidArgument, NotFound, Unavailable
from omni_common.runtime.rpc import aio_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger("omnistage.coordinator")

INFO_TIMEOUT_S = 2.0


@dataclass
class Replica:
    stage: str
    address: str
    stub: stage_pb2_grpc.StageStub
    info: stage_pb2.StageInfo | None = None
    failures: int = 0

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.failures == 0


@dataclass
class ReplicaPool:
    """Replicas per stage; `refresh` asks each one for its Info."""

    replicas: dict[str, list[Replica]] = field(default_factory=dict)
    _turn: dict[str, itertools.count[int]] = field(default_factory=dict)

    @classmethod
    def from_addresses(cls, addresses: dict[str, list[str]]) -> ReplicaPool:
        pool = cls()
        for stage, stage_addresses in addresses.items():
            pool.replicas[stage] = [
                Replica(stage, address, stage_pb2_grpc.StageStub(aio_channel(address)))
                for address in stage_addresses
            ]
            pool._turn[stage] = itertools.count()
        return pool

    async def refresh(self) -> None:
        everyone = [replica for replicas in self.replicas.values() for replica in replicas]
        await asyncio.gather(*(self._refresh_one(replica) for replica in everyone))

    async def _refresh_one(self, replica: Replica) -> None:
        try:
            info = await replica.stub.Info(stage_pb2.StageInfoRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.RpcError as err:
            if replica.failures == 0:
                log.warning("%s replica %s unreachable: %s", replica.stage, replica.address, err)
            replica.failures += 1
            return
        if info.stage != replica.stage:
            log.error("%s at %s says it is a %s; ignoring it", replica.stage, replica.address, info.stage)
            replica.failures += 1
            return
        if replica.failures or replica.info is None:
            log.info(
                "%s replica %s ready: model %s on %s", replica.stage, replica.address, info.model, info.device
            )
        replica.info, replica.failures = info, 0

    async def keep_fresh(self, period_s: float = 2.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(period_s)

    def mark_failed(self, replica: Replica) -> None:
        replica.failures += 1

    def models(self) -> dict[str, tuple[str, dict[str, int]]]:
        """Model name -> (family, healthy replicas per stage)."""
        found: dict[str, tuple[str, dict[str, int]]] = {}
        for stage, replicas in self.replicas.items():
            for replica in replicas:
                if replica.healthy and replica.info is not None:
                    _, counts = found.setdefault(replica.info.model, (replica.info.family, {}))
                    counts[stage] = counts.get(stage, 0) + 1
        return found

    def resolve_model(self, name: str) -> str:
        """ "" means the only model served; unknown names are NOT_FOUND."""
        served = sorted(self.models())
        if not name and len(served) == 1:
            return served[0]
        if name in served:
            return name
        if not served:
            raise Unavailable("no stage replica is ready yet; retry in a few seconds")
        if not name:
            raise InvalidArgument(f"several models are served ({', '.join(served)}); name one")
        raise NotFound(f"unknown model {name[:100]!r}; served: {', '.join(served)}")

    def pick(self, stage: str, model: str) -> Replica:
        """Round robin over healthy replicas of `stage` serving `model`."""
        candidates = [
            r
            for r in self.replicas.get(stage, [])
            if r.healthy and r.info is not None and r.info.model == model
        ]
        if not candidates:
            raise Unavailable(f"no healthy {stage} replica serves {model!r}; retry later")
        return candidates[next(self._turn[stage]) % len(candidates)]
