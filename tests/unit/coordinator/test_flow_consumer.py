"""The coordinator tells each stage who will consume its output, GPU included, so that the
producer can choose CUDA IPC; the last stage's consumer is the coordinator, with no GPU."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import torch

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage import QwenImageFamily
from omni_common.runtime.calls import FINISHED_WITH
from omni_common.transport import TensorTransport, encode_inline
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.flow import RequestFlow
from services.coordinator.registry import Replica, ReplicaPool

STAGES = ("ar-encoder", "dit-denoise", "vae-decode")
PLAN = QwenImageFamily().plan(GenerationRequest(prompt="a cat"))


class RecordingStub:
    """A stage that answers every Run with a tiny inline "png" and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[stage_pb2.StageRequest] = []

    def Run(
        self, request: stage_pb2.StageRequest, timeout: float | None = None
    ) -> AsyncIterator[stage_pb2.StageEvent]:
        self.requests.append(request)

        async def events() -> AsyncIterator[stage_pb2.StageEvent]:
            png = encode_inline("png", torch.zeros(4, dtype=torch.uint8))
            output = tensor_pb2.StageState(tensors=[png])
            yield stage_pb2.StageEvent(result=stage_pb2.StageResult(output=output))

        return events()


def run_one_request(pool: ReplicaPool, tmp_path: Path, **flow_options: int) -> TensorTransport:
    """One request of PLAN through `pool`'s replicas; the coordinator's transport (closed)."""
    transport = TensorTransport(shm_dir=tmp_path)

    async def emit(event: cpb.GenerateEvent) -> None:
        pass

    try:
        flow = RequestFlow(pool, transport, stage_timeout_s=10, **flow_options)
        asyncio.run(
            flow.run("r1", stage_pb2.GenerationParams(model="m"), cpb.GenerateRequest(), PLAN, None, emit)
        )
    finally:
        transport.close()
    return transport


def test_each_stage_hears_its_consumers_host_namespace_and_gpu(tmp_path: Path) -> None:
    pool = ReplicaPool()
    stubs = {}
    for i, stage in enumerate(STAGES):
        stubs[stage] = RecordingStub()
        info = stage_pb2.StageInfo(
            stage=stage, model="m", host_id="h1", address=f"s{i}:1", gpu_uuid=f"GPU-{i}", ipc_namespace=40 + i
        )
        pool.replicas[stage] = [Replica(stage, info.address, stubs[stage], info=info)]  # type: ignore[arg-type]
    transport = run_one_request(pool, tmp_path)
    [encode], [denoise], [decode] = (stubs[s].requests for s in STAGES)
    assert (encode.consumer_host_id, encode.consumer_gpu_uuid, encode.consumer_ipc_namespace) == (
        "h1",
        "GPU-1",
        41,
    )
    assert (denoise.consumer_host_id, denoise.consumer_gpu_uuid, denoise.consumer_ipc_namespace) == (
        "h1",
        "GPU-2",
        42,
    )
    assert (decode.consumer_host_id, decode.consumer_gpu_uuid) == (transport.host_id, "")


class StoppingStub(RecordingStub):
    """A stage that stops as the call comes: gRPC ends a call that races a server's stop with
    CANCELLED (seen when a drained replica stopped before its deregistration reached the
    coordinator)."""

    def Run(
        self, request: stage_pb2.StageRequest, timeout: float | None = None
    ) -> AsyncIterator[stage_pb2.StageEvent]:
        self.requests.append(request)

        async def events() -> AsyncIterator[stage_pb2.StageEvent]:
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, empty, empty, "CANCELLED")
            yield  # an async generator

        return events()


def run_with_dit_replicas(
    tmp_path: Path, count: int, first: type[RecordingStub] = RecordingStub
) -> list[stage_pb2.StageRequest]:
    """One request through a pool with `count` DiT replicas, the first of them a `first`;
    the DiT calls it made."""
    pool = ReplicaPool()
    dits = []
    for stage in STAGES:
        for i in range(count if stage == "dit-denoise" else 1):
            stub = first() if stage == "dit-denoise" and i == 0 else RecordingStub()
            info = stage_pb2.StageInfo(stage=stage, model="m", host_id="h1", address=f"{stage}-{i}:1")
            pool.replicas.setdefault(stage, []).append(Replica(stage, info.address, stub, info=info))  # type: ignore[arg-type]
            if stage == "dit-denoise":
                dits.append(stub)
    run_one_request(pool, tmp_path, checkpoint_every=5)
    return [request for stub in dits for request in stub.requests]


def test_the_dit_checkpoints_only_when_another_replica_could_resume(tmp_path: Path) -> None:
    [alone] = run_with_dit_replicas(tmp_path, 1)
    assert alone.checkpoint_every == 0  # nothing to fail over to: checkpoints would only cost
    [with_peer] = run_with_dit_replicas(tmp_path, 2)
    assert with_peer.checkpoint_every == 5


def test_a_call_cancelled_by_a_stopping_replica_moves_to_another(tmp_path: Path) -> None:
    calls = run_with_dit_replicas(tmp_path, 2, first=StoppingStub)
    assert len(calls) == 2  # the stopping replica's, then the other's (which finished it)


class FinishedWithStub(RecordingStub):
    """A DiT whose step finished this request with 3 others (FINISHED_WITH in its output)."""

    def Run(
        self, request: stage_pb2.StageRequest, timeout: float | None = None
    ) -> AsyncIterator[stage_pb2.StageEvent]:
        self.requests.append(request)

        async def events() -> AsyncIterator[stage_pb2.StageEvent]:
            latents = encode_inline("latents", torch.zeros(4))
            output = tensor_pb2.StageState(tensors=[latents], meta={FINISHED_WITH: "3"})
            yield stage_pb2.StageEvent(result=stage_pb2.StageResult(output=output))

        return events()


def test_the_decode_hears_how_many_requests_the_dits_step_finished_with_its_own(tmp_path: Path) -> None:
    """So that vae-decode waits for them (batching.FOLLOWERS_WAIT_S) instead of decoding the
    first alone."""
    pool = ReplicaPool()
    stubs: dict[str, RecordingStub] = {}
    for stage in STAGES:
        stubs[stage] = FinishedWithStub() if stage == "dit-denoise" else RecordingStub()
        info = stage_pb2.StageInfo(stage=stage, model="m", host_id="h1", address=f"{stage}:1")
        pool.replicas[stage] = [Replica(stage, info.address, stubs[stage], info=info)]  # type: ignore[arg-type]
    run_one_request(pool, tmp_path)
    [decode] = stubs["vae-decode"].requests
    assert decode.followers == 3
    [denoise] = stubs["dit-denoise"].requests
    assert denoise.followers == 0  # the encoder's output says nothing of others
