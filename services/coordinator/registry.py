"""Stage replicas known to the coordinator and how one is picked for a request.

Replicas come from two places: static addresses in the configuration (asked for their
StageInfo every couple of seconds) and self-registration (each heartbeat is a lease; a
replica that stops heartbeating is dropped). Routing takes the least-loaded healthy
replica of a stage that serves the model and the role a plan step asks for, by the stage's
own signal plus the calls this coordinator has in flight there, preferring one on the host
that holds the request's data, or one that keeps state the call reuses (a conversation's prefix
KV: affinity.py) unless it is much busier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from omni_common.errors import InvalidArgument, NotFound, Unavailable
from omni_common.models.base import ModelFamily, roles_of
from omni_common.models.registry import find_family
from omni_common.net.auth import cluster_metadata
from omni_common.net.rpc import aio_channel
from omni_common.net.tls import client_settings
from omni_common.stages import STAGES
from omnistage.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc

log = logging.getLogger("omnistage.coordinator")

INFO_TIMEOUT_S = 2.0
# Calls in flight by which a replica that keeps a call's reusable state (a conversation's prefix
# KV) may exceed the least-loaded one and still get the call: a generator batches its calls, so
# a couple more rows cost it less than the prefill the kept state saves.
PREFER_SLACK = 2
HEARTBEAT_LEASE_S = 3.0


@dataclass(eq=False)
class Replica:
    stage: str
    address: str
    stub: stage_pb2_grpc.StageStub
    info: stage_pb2.StageInfo | None = None
    failures: int = 0
    in_flight: int = 0  # calls this coordinator has running there
    expires_at: float | None = None  # heartbeat lease (None: static, refreshed by Info)
    control: stage_pb2_grpc.StageControlStub | None = None  # sleep/wake, on the same channel

    @property
    def healthy(self) -> bool:
        """It answers: calls to it, and reads of its tensors, can succeed."""
        return self.info is not None and self.failures == 0

    @property
    def draining(self) -> bool:
        """It drains but lingers (StageInfo.draining): healthy, given no new work, still asked
        for the prefixes it keeps (prefix_move.py)."""
        return self.info is not None and self.info.draining

    @property
    def takes_work(self) -> bool:
        """Healthy and not draining: a call may be sent to it."""
        return self.healthy and not self.draining

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles it serves; a replica that predates roles serves all of its stage's."""
        if self.info is None:
            return ()
        if self.info.roles:
            return tuple(self.info.roles)
        family = find_family(self.info.family)
        return roles_of(family, self.stage) if family is not None else ()

    def serves(self, role: str) -> bool:
        """Whether it serves `role` ("" = any); one that names no roles and no family we know
        predates roles: it serves the one its stage had."""
        if not role or (
            self.info is not None and not self.info.roles and find_family(self.info.family) is None
        ):
            return True
        return role in self.roles

    def score(self, near_host: str, loras: frozenset[str] = frozenset()) -> tuple[int, int, int, int]:
        """Lower is better: holding the request's LoRA adapters first (another replica would
        have to load them), then the same host, fewest calls in flight, the stage's load."""
        assert self.info is not None
        missing = len(loras - set(self.info.loras)) if loras else 0
        return (missing, 0 if self.info.host_id == near_host else 1, self.in_flight, self.info.load)


@dataclass
class ModelView:
    """What the pool knows of one served model."""

    family: str
    stages: dict[str, int] = field(default_factory=dict)  # healthy replicas per stage
    roles: dict[str, int] = field(default_factory=dict)  # healthy replicas per role
    loras: dict[str, int] = field(default_factory=dict)  # healthy replicas per loaded adapter
    # The model directory's own defaults (StageInfo.model_defaults / option_defaults); every
    # replica reads the same directory, so any one that sends them speaks for the model.
    model_defaults: dict[str, float] = field(default_factory=dict)
    option_defaults: dict[str, str] = field(default_factory=dict)

    def ready(self) -> bool:
        """Every role of the model's family has a healthy replica."""
        family = find_family(self.family)
        return family is not None and all(self.roles.get(role.name) for role in family.roles)


@dataclass
class ReplicaPool:
    replicas: dict[str, list[Replica]] = field(default_factory=dict)
    # Every replica address ever routed to (kept after one leaves): what a public caller's
    # events and errors must not show (CoordinatorServicer hides them from API-key callers).
    addresses_seen: set[str] = field(default_factory=set)

    @classmethod
    def from_addresses(cls, addresses: dict[str, list[str]]) -> ReplicaPool:
        pool = cls()
        for stage, stage_addresses in addresses.items():
            for address in stage_addresses:
                pool._add(stage, address)
        return pool

    def _add(self, stage: str, address: str) -> Replica:
        channel = aio_channel(address, metadata=cluster_metadata())
        replica = Replica(
            stage,
            address,
            stage_pb2_grpc.StageStub(channel),
            control=stage_pb2_grpc.StageControlStub(channel),
        )
        self.replicas.setdefault(stage, []).append(replica)
        self.addresses_seen.add(address)
        return replica

    def find(self, stage: str, address: str) -> Replica | None:
        return next((r for r in self.replicas.get(stage, []) if r.address == address), None)

    def register(self, info: stage_pb2.StageInfo) -> None:
        """A heartbeat: add the replica or refresh its info and lease."""
        replica = self.find(info.stage, info.address)
        if replica is None:
            replica = self._add(info.stage, info.address)
            log.info(
                "%s replica %s registered (model %s on %s)", info.stage, info.address, info.model, info.device
            )
        if replica.expires_at is not None or replica.info is None:
            replica.expires_at = time.monotonic() + HEARTBEAT_LEASE_S
        replica.info, replica.failures = info, 0

    def deregister(self, stage: str, address: str) -> None:
        replica = self.find(stage, address)
        if replica is not None:
            self.replicas[stage].remove(replica)
            log.info("%s replica %s deregistered", stage, address)

    def expire(self) -> None:
        now = time.monotonic()
        for stage, replicas in self.replicas.items():
            for replica in [r for r in replicas if r.expires_at is not None and r.expires_at < now]:
                replicas.remove(replica)
                log.warning("%s replica %s stopped heartbeating; dropped", stage, replica.address)

    async def refresh(self) -> None:
        """Ask the static replicas for their Info; drop registered ones whose lease ran out."""
        self.expire()
        static = [r for replicas in self.replicas.values() for r in replicas if r.expires_at is None]
        await asyncio.gather(*(self._refresh_one(replica) for replica in static))

    async def _refresh_one(self, replica: Replica) -> None:
        try:
            info = await replica.stub.Info(stage_pb2.StageInfoRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.RpcError as err:
            if replica.failures == 0:
                log.warning("%s replica %s unreachable: %s", replica.stage, replica.address, err.code().name)
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

    async def keep_fresh(self, period_s: float = 1.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(period_s)

    def mark_failed(self, replica: Replica) -> None:
        replica.failures += 1

    def models(self) -> dict[str, ModelView]:
        """Model name -> its family and healthy replicas per stage and per role."""
        found: dict[str, ModelView] = {}
        for stage, replicas in self.replicas.items():
            for replica in replicas:
                if replica.takes_work and replica.info is not None:
                    view = found.setdefault(replica.info.model, ModelView(replica.info.family))
                    view.stages[stage] = view.stages.get(stage, 0) + 1
                    for role in replica.roles:
                        view.roles[role] = view.roles.get(role, 0) + 1
                    for lora in replica.info.loras:
                        view.loras[lora] = view.loras.get(lora, 0) + 1
                    view.model_defaults.update(replica.info.model_defaults)
                    view.option_defaults.update(replica.info.option_defaults)
        return found

    def family_of(self, model: str) -> ModelFamily:
        """The family a served model belongs to (as its replicas say)."""
        view = self.models().get(model)
        if view is None:
            raise NotFound(f"unknown model {model[:100]!r}")
        family = find_family(view.family)
        if family is None:
            raise Unavailable(
                f"model {model!r} is of family {view.family!r}, which this coordinator does not know"
            )
        return family

    def by_address(self, address: str) -> Replica | None:
        return next((r for rs in self.replicas.values() for r in rs if r.address == address), None)

    def is_alive(self, address: str) -> bool:
        """Whether a replica at `address` is registered and healthy (its leases can be read)."""
        replica = self.by_address(address)
        return replica is not None and replica.healthy

    async def probe(self, address: str) -> bool:
        """Ask the replica at `address` now whether it is alive (a consumer just failed to
        read from it, before the next health round would tell); an unreachable one counts a
        failure, so is_alive says so from now on."""
        replica = self.by_address(address)
        if replica is None:
            return False
        await self._refresh_one(replica)
        return replica.healthy

    def healthy_counts(self) -> dict[str, int]:
        """Healthy replicas per stage that take work (not draining), whatever model they serve."""
        return {stage: sum(r.takes_work for r in replicas) for stage, replicas in self.replicas.items()}

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

    def serving(self, stage: str, model: str, role: str = "") -> list[Replica]:
        """The healthy replicas of `stage` that serve `model` (and `role`, when given), less
        those that drain."""
        replicas = self.replicas.get(stage, [])
        return [
            r
            for r in replicas
            if r.takes_work and r.info is not None and r.info.model == model and r.serves(role)
        ]

    def pick(
        self,
        stage: str,
        model: str,
        *,
        role: str = "",
        near_host: str = "",
        avoid: frozenset[str] = frozenset(),
        loras: frozenset[str] = frozenset(),
        prefer: str = "",
    ) -> Replica:
        """The least-loaded healthy replica of `stage` serving `model` and `role`, not in `avoid`,
        preferring one that holds the LoRA adapters `loras`; the replica at `prefer` (it keeps
        state the call reuses) unless it has PREFER_SLACK more calls in flight than that one."""
        candidates = [r for r in self.serving(stage, model, role) if r.address not in avoid]
        if not candidates:
            what = f"{stage} replica ({role})" if role else f"{stage} replica"
            raise Unavailable(f"no healthy {what} serves {model!r}; retry later")
        best = min(candidates, key=lambda r: r.score(near_host, loras))
        held = next((r for r in candidates if prefer and r.address == prefer), None)
        if held is not None and held.in_flight <= best.in_flight + PREFER_SLACK:
            return held
        return best


MAX_NAME_CHARS = 256


def heartbeat_problem(info: stage_pb2.StageInfo) -> str:
    """Why a replica's StageInfo cannot be routed to ("" when it can): requests would follow
    it, so it must name a stage, a family this coordinator knows, a model and a host:port."""
    if info.stage not in STAGES:
        return "unknown stage"
    if find_family(info.family) is None:
        return "unknown model family"
    if not info.model or len(info.model) > MAX_NAME_CHARS or not info.model.isprintable():
        return "the model name must be 1-256 printable characters"
    host, _, port = info.address.rpartition(":")
    if not host or len(info.address) > MAX_NAME_CHARS or not port.isdigit() or not 0 < int(port) < 65536:
        return "the address must be host:port"
    if any(c.isspace() or not c.isprintable() or c in "/?#@" for c in host):
        return "the address must be host:port"
    return ""


async def proves_identity(info: stage_pb2.StageInfo) -> bool:
    """With TLS, whether the replica a first heartbeat names is the one registering: the
    coordinator dials the address it registers, verifies the certificate there against the
    cluster's CA (a forged heartbeat can name any address, but only a holder of a cluster
    certificate can answer at it), and that replica must say the same stage, model and
    address. Plaintext clusters cannot tell (True): there the cluster token is the whole of a
    replica's identity, and a token holder may register any address (README, Access control)."""
    if not client_settings().verifies_peers:
        return True
    channel = aio_channel(info.address, metadata=cluster_metadata())
    try:
        said = await stage_pb2_grpc.StageStub(channel).Info(
            stage_pb2.StageInfoRequest(), timeout=INFO_TIMEOUT_S
        )
    except grpc.RpcError as err:
        log.warning("heartbeat for %s %s refused: it answers %s", info.stage, info.address, err.code().name)
        return False
    finally:
        await channel.close()
    return (said.stage, said.model, said.address) == (info.stage, info.model, info.address)


class RegistryServicer(coordinator_pb2_grpc.RegistryServicer):
    """Where replicas register and heartbeat."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    async def Heartbeat(
        self, request: stage_pb2.StageInfo, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatReply:
        problem = heartbeat_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"heartbeat refused: {problem}")
        if self.pool.find(request.stage, request.address) is None and not await proves_identity(request):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "heartbeat refused: the address registered does not answer, over TLS with a "
                "certificate of this cluster, as the replica that registers it",
            )
        self.pool.register(request)
        return coordinator_pb2.HeartbeatReply(lease_ms=int(HEARTBEAT_LEASE_S * 1000))

    async def Deregister(
        self, request: stage_pb2.StageInfo, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatReply:
        self.pool.deregister(request.stage, request.address)
        return coordinator_pb2.HeartbeatReply()
