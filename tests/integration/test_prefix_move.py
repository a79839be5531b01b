"""A conversation's prefix KV moved between thinker replicas, through real gRPC servers and shared
memory, with two thinker replicas (the tiny Qwen2.5-Omni, CPU, fp32): when the replica that
served turn 1 is much busier, turn 2 runs on the other one with turn 1's KV moved there by
handle (its prefix cache counts the hit) and replies as a coordinator without affinity does,
text and waveform bitwise, with every lease released; when that replica is dead, turn 2
recomputes the prefix on the other one, with the same reply."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from omni_common.chat import Reply
from omni_common.cluster import free_port
from omni_common.net.rpc import sync_channel
from omni_common.runtime.config import CoordinatorConfig
from omni_common.runtime.serve import serve
from omni_common.transport import TensorTransport, add_tensor_store, encode_inline
from omnistage.v1 import coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2
from services.coordinator.registry import PREFER_SLACK, RegistryServicer, ReplicaPool
from services.coordinator.server import CoordinatorServicer
from tests.integration.conftest import InProcessCluster, scrape
from tests.integration.test_conversation_affinity import SECOND, plain_coordinator, replica_hits, turn
from tests.integration.test_generate import wait_until_no_leases
from tests.integration.test_qwen_omni_media import USER_TURNS, clip


@pytest.fixture(scope="module")
def pair(omni_model: Path) -> Iterator[InProcessCluster]:
    """Two ar-encoder replicas (each serves the thinker and the talker), each with its metrics
    (the last test stops one)."""
    running = InProcessCluster(
        omni_model,
        stage_options={"ar-encoder": {"metrics_port": free_port()}},
        extra_replicas={SECOND: {"metrics_port": free_port()}},
    )
    running.start()
    yield running
    running.stop()
    for transport in running.transports.values():  # no segment outlives its replica
        assert not list(transport.shm_dir.glob(f"omnistage-{transport.token}-*"))


@contextlib.contextmanager
def held_coordinator(cluster: InProcessCluster) -> Iterator[tuple[str, ReplicaPool, int, TensorTransport]]:
    """A coordinator over the pair whose replica pool the test holds (to make a replica busy):
    its address, its pool, its metrics port and its transport."""
    replicas = {"ar-encoder": [cluster.addresses["ar-encoder"], cluster.addresses[SECOND]]}
    replicas |= {stage: [cluster.addresses[stage]] for stage in ("dit-denoise", "vae-decode")}
    config = CoordinatorConfig(replicas=replicas, port=0, metrics_port=free_port())  # type: ignore[arg-type]
    pool, transport = cluster.call(_pool(replicas)), TensorTransport()  # its channels: the loop's
    servicer = CoordinatorServicer(pool, transport, config)
    address: list[str] = []
    ready, stop = threading.Event(), asyncio.Event()

    async def setup(server, where: str) -> None:  # type: ignore[no-untyped-def]
        transport.address = where
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
        coordinator_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(pool), server)
        add_tensor_store(server, transport)
        await pool.refresh()

    def mark(where: str) -> None:
        address.append(where)
        ready.set()

    serving = serve(
        "coordinator",
        config.bind_address,
        setup,
        is_idle=lambda: not servicer.in_flight,
        on_stop=transport.close,
        ready=mark,
        stop=stop,
        metrics=servicer.metrics.registry,
        metrics_port=config.metrics_port,
    )
    task = asyncio.run_coroutine_threadsafe(serving, cluster.loop)
    while not ready.wait(0.1):
        if task.done():
            task.result()
    try:
        assert isinstance(config.metrics_port, int)
        yield address[0], pool, config.metrics_port, transport
    finally:
        cluster.loop.call_soon_threadsafe(stop.set)
        task.result(60)


async def _pool(replicas: dict[str, list[str]]) -> ReplicaPool:
    return ReplicaPool.from_addresses(replicas)


def moves(port: int) -> dict[str, float]:
    samples = scrape(port)
    return {
        outcome: samples.get(("omnistage_prefix_moves_total", frozenset({("outcome", outcome)})), 0.0)
        for outcome in ("moved", "recomputed", "absent", "failed")
    }


def busy(cluster: InProcessCluster, pool: ReplicaPool, address: str, calls: int) -> None:
    """Count `calls` more calls in flight at `address` in `pool` (on the cluster's loop, which
    owns the pool): the pool then prefers the other replica over the one keeping the prefix."""

    async def add() -> None:
        replica = pool.by_address(address)
        assert replica is not None
        replica.in_flight += calls

    cluster.call(add())


def two_turns(coordinator: str, audio: bytes) -> tuple[list[dict[str, object]], Reply, str]:
    """Turn 1 of a conversation: the history for turn 2, turn 1's reply and its thinker."""
    history: list[dict[str, object]] = [{"role": "user", "content": USER_TURNS[0]}]
    first, served = turn(coordinator, history, audio)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": USER_TURNS[1]}]
    return history, first, served


def the_same(reply: Reply, expected: Reply) -> None:
    assert reply.text == expected.text
    np.testing.assert_array_equal(reply.audio, expected.audio)


def test_turn_two_away_from_its_prefix_gets_the_kv_moved_and_replies_the_same(pair: InProcessCluster) -> None:
    audio = clip(seed=21)
    with held_coordinator(pair) as (coordinator, pool, metrics, transport):
        history, _, holder = two_turns(coordinator, audio)
        other = next(a for a in (pair.addresses["ar-encoder"], pair.addresses[SECOND]) if a != holder)
        before, moved_before = replica_hits(pair), moves(metrics)
        busy(pair, pool, holder, PREFER_SLACK + 1)
        second, thinker = turn(coordinator, history, audio)
        busy(pair, pool, holder, -(PREFER_SLACK + 1))
        assert thinker == other
        after = replica_hits(pair)
        assert after[other] == before[other] + 1, "the moved prefix was not a hit"
        assert after[holder] == before[holder]
        assert moves(metrics)["moved"] == moved_before["moved"] + 1
        wait_until_no_leases(pair)
        assert transport.live_leases() == 0
    with plain_coordinator(pair) as plain:
        without, _ = turn(plain, history, audio)
    the_same(second, without)


def stage_run(address: str, request: stage_pb2.StageRequest) -> list[stage_pb2.StageEvent]:
    with sync_channel(address) as channel:
        return list(stage_pb2_grpc.StageStub(channel).Run(request, timeout=60))


def refusal(address: str, request: stage_pb2.StageRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        stage_run(address, request)
    assert "Traceback" not in (caught.value.details() or "")
    return caught.value


def test_an_export_or_a_moved_prefix_that_cannot_be_is_refused_clearly(pair: InProcessCluster) -> None:
    address = pair.addresses["ar-encoder"]
    with sync_channel(address) as channel:
        model = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.StageInfoRequest()).model
    params = stage_pb2.GenerationParams(
        model=model,
        prompt="Nothing kept.",
        width=64,
        height=64,
        num_inference_steps=10,
        true_cfg_scale=0.5,
        max_sequence_length=512,
        options={"audio": "0", "max_new_tokens": "2"},
    )
    nothing = stage_pb2.StageRequest(request_id="export", params=params, role="thinker", export_prefix=True)
    (event,) = stage_run(address, nothing)
    assert not event.result.output.tensors  # nothing kept of that prompt: an empty output
    talker = stage_pb2.StageRequest(request_id="export", params=params, role="talker", export_prefix=True)
    refused = refusal(address, talker)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "keeps no prefixes" in refused.details()
    misfit = tensor_pb2.StageState(
        tensors=[encode_inline("prefix.keys.0", torch.zeros(1, 1, 2, 1))],
        meta={"prefix.length": "2", "prefix.key": "0" * 64},
    )
    run = stage_pb2.StageRequest(request_id="misfit", params=params, role="thinker", input=misfit)
    assert refusal(address, run).code() == grpc.StatusCode.INVALID_ARGUMENT
    forged = tensor_pb2.StageState(meta={"prefix.length": "2", "prefix.key": "0" * 64})
    ref = forged.tensors.add(name="prefix.keys.0", dtype="float32", shape=[1, 1, 2, 1], nbytes=8)
    ref.shm.arena_id, ref.shm.nbytes, ref.shm.lease_id = "0" * 16 + "-0", 8, "forged"
    run = stage_pb2.StageRequest(request_id="forged", params=params, role="thinker", input=forged)
    assert refusal(address, run).code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    (event,) = [e for e in stage_run(address, nothing) if e.HasField("result")]  # still serving
    wait_until_no_leases(pair)


def test_turn_two_recomputes_when_the_prefixs_replica_is_dead(pair: InProcessCluster) -> None:
    audio = clip(seed=22)
    with held_coordinator(pair) as (coordinator, pool, metrics, _):
        history, _, holder = two_turns(coordinator, audio)
        gone = next(name for name in ("ar-encoder", SECOND) if pair.addresses[name] == holder)
        other = next(a for a in (pair.addresses["ar-encoder"], pair.addresses[SECOND]) if a != holder)
        before, moved_before = replica_hits(pair)[other], moves(metrics)
        busy(pair, pool, holder, PREFER_SLACK + 1)  # the pool may not know yet that it died
        pair.stop_replica(gone)
        second, thinker = turn(coordinator, history, audio)
        assert thinker == other
        hits = scrape_hits(pair, other)
        assert hits == before, "nothing was moved, so nothing was reused"
        # This coordinator's pool is not refreshed: it still takes the dead replica for alive,
        # so the export is tried, fails, and the turn computes its prompt.
        assert moves(metrics) == {**moved_before, "failed": moved_before["failed"] + 1}
    with plain_coordinator(pair) as plain:
        without, _ = turn(plain, history, audio)
    the_same(second, without)


def scrape_hits(cluster: InProcessCluster, address: str) -> float:
    """The prefix cache hits of the live replica at `address`."""
    name = next(n for n in ("ar-encoder", SECOND) if cluster.addresses[n] == address)
    port = {**cluster.stage_options["ar-encoder"], **cluster.extra_replicas.get(name, {})}["metrics_port"]
    assert isinstance(port, int)
    labels = frozenset({("stage", "ar-encoder"), ("role", "thinker")})
    return scrape(port).get(("omnistage_prefix_cache_hits", labels), 0.0)
