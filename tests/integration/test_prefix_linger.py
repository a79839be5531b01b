"""A thinker replica that drains while it keeps a conversation's prefix KV (--drain-linger-s),
through real gRPC servers and shared memory (the tiny Qwen2.5-Omni, CPU, fp32): it takes no new
work, the conversation's next turn runs on the other replica with the KV moved from the
draining one (the receiver counts the hit) and replies as a coordinator without affinity does,
and the draining replica stops once its linger is over and its leases are released."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from omni_common.cluster import free_port
from omnistage.v1 import stage_pb2
from services.coordinator.registry import ReplicaPool
from tests.integration.conftest import InProcessCluster
from tests.integration.test_conversation_affinity import SECOND, plain_coordinator, replica_hits, turn
from tests.integration.test_prefix_move import held_coordinator, moves, refusal, the_same, two_turns
from tests.integration.test_qwen_omni_media import clip

# Long enough for turn 2 on the tiny model on a slow machine; the test waits it out once.
LINGER_S = 20.0


@pytest.fixture(scope="module")
def lingering_pair(omni_model: Path) -> Iterator[InProcessCluster]:
    """Two ar-encoder replicas that linger when drained, each with its metrics."""
    running = InProcessCluster(
        omni_model,
        stage_options={"ar-encoder": {"metrics_port": free_port(), "drain_linger_s": LINGER_S}},
        extra_replicas={SECOND: {"metrics_port": free_port()}},
    )
    running.start()
    yield running
    running.stop()


def seen_draining(cluster: InProcessCluster, pool: ReplicaPool, address: str) -> bool:
    """Refresh `pool` (static replicas answer Info) until the replica at `address` says it
    drains; False if it did not within 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        cluster.call(pool.refresh())
        replica = pool.by_address(address)
        if replica is not None and replica.draining:
            return True
    return False


def test_turn_two_gets_the_kv_moved_from_a_replica_that_drains(lingering_pair: InProcessCluster) -> None:
    pair, audio = lingering_pair, clip(seed=23)
    with held_coordinator(pair) as (coordinator, pool, metrics, transport):
        history, _, holder = two_turns(coordinator, audio)
        name = next(n for n in ("ar-encoder", SECOND) if pair.addresses[n] == holder)
        other = next(a for a in (pair.addresses["ar-encoder"], pair.addresses[SECOND]) if a != holder)
        before, moved_before = replica_hits(pair), moves(metrics)
        pair.drain_replica(name)
        assert seen_draining(pair, pool, holder), "the draining replica did not say so"
        params = stage_pb2.GenerationParams(model="m", prompt="new work", options={"audio": "0"})
        new_work = stage_pb2.StageRequest(request_id="late", params=params, role="thinker")
        refused = refusal(holder, new_work)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
        second, thinker = turn(coordinator, history, audio)
        assert thinker == other
        assert replica_hits(pair)[other] == before[other] + 1, "the moved prefix was not a hit"
        assert moves(metrics)["moved"] == moved_before["moved"] + 1
        pair.stop_replica(name)  # the linger ends; its leases were released, so it stops
        assert transport.live_leases() == 0
    with plain_coordinator(pair) as plain:
        without, _ = turn(plain, history, audio)
    the_same(second, without)
