"""The choice between moving a conversation's prefix KV and recomputing it: move when the bytes
over the handles' rate take less time than prefilling the tokens at the configured rate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import torch
from prometheus_client import CollectorRegistry

from omni_common.models.base import ChatTurn, GenerationRequest, PrefixKeys
from omni_common.models.qwen_omni.family import QwenOmniFamily
from omni_common.transport import TensorTransport, encode_inline
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.affinity import PrefixRoutes
from services.coordinator.leases import Leases
from services.coordinator.prefix_move import (
    LINK_BYTES_PER_S,
    PrefixMoves,
    should_move,
    slowest_location,
    with_prefix,
)
from services.coordinator.registry import Replica, ReplicaPool
from services.coordinator.request import FlowRequest

# The 7B thinker's KV of one token: 28 layers x (keys + values) x 4 heads x 128 x bf16, plus its
# talker row (3584 x bf16).
TOKEN_BYTES = 28 * 2 * 4 * 128 * 2 + 3584 * 2


PLAN = QwenOmniFamily().plan(
    GenerationRequest(prompt="", messages=(ChatTurn("user", (("text", "hi"),)),), options=(("audio", "0"),))
)


def test_a_same_host_move_beats_the_prefill_and_a_slow_link_does_not() -> None:
    tokens = 2000
    assert should_move(tokens * TOKEN_BYTES, tokens, "shm", prefill_tokens_per_s=10_000)
    assert should_move(tokens * TOKEN_BYTES, tokens, "cuda_ipc", prefill_tokens_per_s=10_000)
    assert not should_move(tokens * TOKEN_BYTES, tokens, "remote", prefill_tokens_per_s=10_000)
    # A slow prefill (a big model on a small device) makes even the slow link pay.
    assert should_move(tokens * TOKEN_BYTES, tokens, "remote", prefill_tokens_per_s=1_000)


def test_the_choice_turns_where_the_two_times_meet() -> None:
    rate = LINK_BYTES_PER_S["shm"]
    # 1000 tokens at 1000 tokens/s take 1 s; moving `rate` bytes takes 1 s too.
    assert not should_move(int(rate), 1000, "shm", prefill_tokens_per_s=1000)
    assert should_move(int(rate) - 1, 1000, "shm", prefill_tokens_per_s=1000)


def test_no_tokens_or_no_rate_recomputes() -> None:
    assert not should_move(1, 0, "shm", prefill_tokens_per_s=10_000)
    assert not should_move(1, 100, "shm", prefill_tokens_per_s=0)


def ref(location: str) -> tensor_pb2.TensorRef:
    tensor = tensor_pb2.TensorRef(name="prefix.keys.0", nbytes=4)
    if location == "remote":
        tensor.remote.producer_address = "10.0.0.1:1"
    elif location == "shm":
        tensor.shm.nbytes = 4
    else:
        tensor.inline_data = b"0000"
    return tensor


def test_the_slowest_handle_sets_the_rate() -> None:
    assert slowest_location(tensor_pb2.StageState(tensors=[ref("shm"), ref("inline")])) == "inline_data"
    assert slowest_location(tensor_pb2.StageState(tensors=[ref("shm"), ref("remote")])) == "remote"
    assert slowest_location(tensor_pb2.StageState(tensors=[ref("shm")])) == "shm"


def test_with_prefix_adds_the_handles_to_a_copy() -> None:
    inputs = tensor_pb2.StageState(tensors=[ref("inline")], meta={"a": "1"})
    moved = tensor_pb2.StageState(tensors=[ref("shm")], meta={"prefix.length": "3"})
    joined = with_prefix(inputs, moved)
    assert len(joined.tensors) == 2 and dict(joined.meta) == {"a": "1", "prefix.length": "3"}
    assert len(inputs.tensors) == 1 and dict(inputs.meta) == {"a": "1"}
    assert with_prefix(inputs, None) is inputs


def test_the_holder_is_remembered_even_when_it_may_not_take_the_turn() -> None:
    routes = PrefixRoutes(8)
    first = PrefixKeys(reuses=(), leaves="one")
    routes.remember("m", first, "a:1")
    second = PrefixKeys(reuses=("one",), leaves="two")
    assert routes.holder("m", second) == "a:1"
    assert routes.holder("other", second) == "" and routes.holder("m", None) == ""
    assert routes.preferred("m", second, usable={"b:1"}) == ""  # a:1 is not usable: forgotten
    assert routes.holder("m", second) == ""


class ExportingStub:
    """A thinker replica whose export answers `output` (or fails UNAVAILABLE when None)."""

    def __init__(self, output: tensor_pb2.StageState | None) -> None:
        self.output = output
        self.requests: list[stage_pb2.StageRequest] = []

    def Run(
        self, request: stage_pb2.StageRequest, timeout: float | None = None
    ) -> AsyncIterator[stage_pb2.StageEvent]:
        self.requests.append(request)

        async def events() -> AsyncIterator[stage_pb2.StageEvent]:
            if self.output is None:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
                )
            yield stage_pb2.StageEvent(result=stage_pb2.StageResult(output=self.output))

        return events()


def exported(tokens: int, nbytes: int) -> tensor_pb2.StageState:
    tensor = encode_inline("prefix.keys.0", torch.zeros(1))
    tensor.nbytes = nbytes  # what the choice reads
    return tensor_pb2.StageState(tensors=[tensor], meta={"prefix.length": str(tokens)})


Fetched = tuple[tensor_pb2.StageState | None, ExportingStub, dict[str, float]]


def fetch_with(output: tensor_pb2.StageState | None, tmp_path: Path) -> Fetched:
    """One fetch from a holder answering `output` for a target on its GPU: its result, the
    holder's stub and the outcomes counted."""
    pool, stub = ReplicaPool(), ExportingStub(output)
    for address, s in (("a:1", stub), ("b:1", ExportingStub(None))):
        info = stage_pb2.StageInfo(stage="ar-encoder", model="m", host_id="h", address=address, gpu_uuid="G")
        replica = Replica("ar-encoder", address, s, info=info)  # type: ignore[arg-type]
        pool.replicas.setdefault("ar-encoder", []).append(replica)
    transport, registry = TensorTransport(shm_dir=tmp_path), CollectorRegistry()
    moves = PrefixMoves(pool, transport, prefill_tokens_per_s=1000, stage_timeout_s=10, registry=registry)

    async def emit(event: cpb.GenerateEvent) -> None:
        pass

    params, options = stage_pb2.GenerationParams(model="m"), cpb.GenerateRequest()
    req = FlowRequest("r", params, options, None, emit, Leases(transport), {}, PLAN)
    target, inputs = pool.replicas["ar-encoder"][1], tensor_pb2.StageState()
    try:
        got = asyncio.run(moves.fetch(req, PLAN.steps[0], "a:1", target, inputs, lambda *_: []))
    finally:
        transport.close()
    outcomes = ("moved", "recomputed", "absent", "failed")
    counts = {o: registry.get_sample_value("omnistage_prefix_moves_total", {"outcome": o}) for o in outcomes}
    return got, stub, {o: n for o, n in counts.items() if n}


def test_a_cheap_move_is_taken_for_the_target_and_counted(tmp_path: Path) -> None:
    got, stub, counts = fetch_with(exported(tokens=1000, nbytes=1000), tmp_path)
    assert got is not None and got.meta["prefix.length"] == "1000"
    (request,) = stub.requests
    assert request.export_prefix and request.role == "thinker" and request.consumer_gpu_uuid == "G"
    assert counts == {"moved": 1.0}


def test_a_dear_move_an_empty_export_and_a_failed_one_recompute(tmp_path: Path) -> None:
    # 1000 tokens at 1000 tokens/s: 1 s; 2 GB inline at 1 GB/s: 2 s.
    got, _, counts = fetch_with(exported(tokens=1000, nbytes=2 * 10**9), tmp_path)
    assert got is None and counts == {"recomputed": 1.0}
    got, _, counts = fetch_with(tensor_pb2.StageState(), tmp_path)
    assert got is None and counts == {"absent": 1.0}
    got, _, counts = fetch_with(None, tmp_path)
    assert got is None and counts == {"failed": 1.0}
