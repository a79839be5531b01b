"""One request through the stages: encode -> denoise -> decode, handles only.

Reads like the diffusers pipeline's __call__, with each model call replaced by a call to a
stage replica. Stage outputs stay in the producing stage's arena; this code passes their
handles on and releases the leases once the next stage has consumed them, and releases
everything of a request that fails or is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from omni_common.errors import OmniError, Unavailable, error_from_rpc
from omni_common.runtime.rpc import CHUNK_BYTES
from omni_common.transport import TensorTransport, release_remote
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.registry import Replica, ReplicaPool

log = logging.getLogger("omnistage.coordinator")

Emit = Callable[[cpb.GenerateEvent], Awaitable[None]]


class Leases:
    """Leases a request holds, per producer address."""

    def __init__(self, transport: TensorTransport) -> None:
        self.transport = transport
        self.held: dict[str, list[str]] = {}

    def add(self, producer: str, state: tensor_pb2.StageState) -> None:
        self.held.setdefault(producer, []).extend(self.transport.lease_ids(state))

    async def release(self, producer: str) -> None:
        lease_ids = self.held.pop(producer, [])
        if not lease_ids:
            return
        try:
            await release_remote(producer, lease_ids)
        except Exception as err:  # the producer may be gone; its leases expire by TTL
            log.warning("could not release %d leases at %s: %s", len(lease_ids), producer, err)

    async def release_all(self) -> None:
        await asyncio.gather(*(self.release(producer) for producer in list(self.held)))


class RequestFlow:
    """Runs requests over a ReplicaPool; one instance per coordinator."""

    def __init__(self, pool: ReplicaPool, transport: TensorTransport, stage_timeout_s: float) -> None:
        self.pool = pool
        self.transport = transport
        self.stage_timeout_s = stage_timeout_s

    async def run(
        self,
        request_id: str,
        params: stage_pb2.GenerationParams,
        *,
        return_tensor: bool,
        progress_every: int,
        emit: Emit,
    ) -> None:
        started = time.perf_counter()
        leases = Leases(self.transport)
        encoder = self.pool.pick("ar-encoder", params.model)
        denoiser = self.pool.pick("dit-denoise", params.model)
        decoder = self.pool.pick("vae-decode", params.model)
        try:
            embeds = await self._call(
                encoder, request_id, params, tensor_pb2.StageState(), denoiser, emit, leases
            )
            latents = await self._call(
                denoiser, request_id, params, embeds, decoder, emit, leases, progress_every
            )
            await leases.release(encoder.address)
            decoded = await self._call(decoder, request_id, params, latents, None, emit, leases)
            await leases.release(denoiser.address)
            await self._send_result(decoded, return_tensor, started, emit)
        finally:
            await leases.release_all()

    async def _call(
        self,
        replica: Replica,
        request_id: str,
        params: stage_pb2.GenerationParams,
        inputs: tensor_pb2.StageState,
        consumer: Replica | None,
        emit: Emit,
        leases: Leases,
        progress_every: int = 0,
    ) -> tensor_pb2.StageState:
        """Run one stage; returns its output handles (their leases are booked in `leases`)."""
        consumer_host = consumer.info.host_id if consumer and consumer.info else self.transport.host_id
        request = stage_pb2.StageRequest(
            request_id=request_id,
            params=params,
            input=inputs,
            consumer_host_id=consumer_host,
            progress_every=progress_every,
        )
        await emit(
            cpb.GenerateEvent(stage_started=cpb.StageStarted(stage=replica.stage, replica=replica.address))
        )
        started = time.perf_counter()
        result: stage_pb2.StageResult | None = None
        try:
            async for event in replica.stub.Run(request, timeout=self.stage_timeout_s):
                if event.HasField("step"):
                    await emit(
                        cpb.GenerateEvent(step=cpb.DenoiseStep(step=event.step.step, total=event.step.total))
                    )
                elif event.HasField("result"):
                    result = event.result
                    leases.add(replica.address, result.output)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_failed(replica)
                raise Unavailable(
                    f"{replica.stage} replica {replica.address} is unavailable; retry the request"
                ) from None
            raise error_from_rpc(err) from None
        if result is None:
            raise OmniError(f"{replica.stage} at {replica.address} ended without a result")
        await emit(
            cpb.GenerateEvent(
                stage_finished=cpb.StageFinished(
                    stage=replica.stage,
                    wall_ms=(time.perf_counter() - started) * 1e3,
                    compute_ms=result.compute_ms,
                )
            )
        )
        return result.output

    async def _send_result(
        self, decoded: tensor_pb2.StageState, return_tensor: bool, started: float, emit: Emit
    ) -> None:
        wanted = {"png", "image"} if return_tensor else {"png"}
        refs = tensor_pb2.StageState(tensors=[t for t in decoded.tensors if t.name in wanted])
        tensors, _ = await self.transport.import_state(refs)
        result = cpb.Result(
            png=tensors["png"].numpy().tobytes(),
            width=int(decoded.meta.get("width", "0")),
            height=int(decoded.meta.get("height", "0")),
        )
        if return_tensor:
            raw = tensors["image"].contiguous().view(-1).view(torch.uint8).numpy()
            for offset in range(0, raw.nbytes, CHUNK_BYTES):
                chunk = raw[offset : offset + CHUNK_BYTES].tobytes()
                await emit(cpb.GenerateEvent(raw_chunk=cpb.RawChunk(offset=offset, data=chunk)))
            image = tensors["image"]
            result.tensor.CopyFrom(
                tensor_pb2.TensorRef(
                    name="image",
                    dtype=str(image.dtype).removeprefix("torch."),
                    shape=list(image.shape),
                    nbytes=raw.nbytes,
                )
            )
        result.total_ms = (time.perf_counter() - started) * 1e3
        await emit(cpb.GenerateEvent(result=result))
