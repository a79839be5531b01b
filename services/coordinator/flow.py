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
from dataclasses import dataclass
from typing import ClassVar

import grpc
import torch

from omni_common.errors import DeadlineExceeded, OmniError, Unavailable, error_from_rpc
from omni_common.runtime.rpc import CHUNK_BYTES
from omni_common.transport import TensorTransport, release_remote
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.registry import Replica, ReplicaPool

log = logging.getLogger("omnistage.coordinator")

Emit = Callable[[cpb.GenerateEvent], Awaitable[None]]


class Leases:
    """Leases a request holds, per producer address.

    Releases run in the background: they free memory but nothing waits on them, so they
    stay off the request's critical path. A producer that is gone lets its leases expire.
    """

    _pending: ClassVar[set[asyncio.Task[None]]] = set()

    def __init__(self, transport: TensorTransport) -> None:
        self.transport = transport
        self.held: dict[str, list[str]] = {}

    def add(self, producer: str, state: tensor_pb2.StageState) -> None:
        self.held.setdefault(producer, []).extend(self.transport.lease_ids(state))

    def release(self, producer: str) -> None:
        lease_ids = self.held.pop(producer, [])
        if lease_ids:
            task = asyncio.get_running_loop().create_task(_release(producer, lease_ids))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    def release_all(self) -> None:
        for producer in list(self.held):
            self.release(producer)


async def _release(producer: str, lease_ids: list[str]) -> None:
    try:
        await release_remote(producer, lease_ids)
    except Exception as err:
        log.warning("could not release %d leases at %s: %s", len(lease_ids), producer, err)


@dataclass
class _Request:
    """What every stage call of one request shares."""

    request_id: str
    params: stage_pb2.GenerationParams
    options: cpb.GenerateRequest
    deadline: float | None  # time.monotonic()
    emit: Emit
    leases: Leases

    def timeout(self, stage_timeout_s: float) -> float:
        """The stage call's timeout: the client's remaining time, capped by the stage limit."""
        if self.deadline is None:
            return stage_timeout_s
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"request {self.request_id}: the deadline passed")
        return min(stage_timeout_s, remaining)


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
        options: cpb.GenerateRequest,
        deadline: float | None,
        emit: Emit,
    ) -> None:
        """Run one validated request; `options` gives the result's format and progress rate,
        `deadline` (time.monotonic()) the client's deadline, which every stage call carries."""
        started = time.perf_counter()
        req = _Request(request_id, params, options, deadline, emit, Leases(self.transport))
        encoder = self.pool.pick("ar-encoder", params.model)
        denoiser = self.pool.pick("dit-denoise", params.model)
        decoder = self.pool.pick("vae-decode", params.model)
        image_output = "rgb8" if options.image_format == cpb.IMAGE_FORMAT_RGB8 else "png"
        outputs = [image_output, "image"] if options.return_tensor else [image_output]
        try:
            embeds = await self._call(req, encoder, tensor_pb2.StageState(), consumer=denoiser)
            latents = await self._call(req, denoiser, embeds, consumer=decoder)
            req.leases.release(encoder.address)
            decoded = await self._call(req, decoder, latents, consumer=None, outputs=outputs)
            req.leases.release(denoiser.address)
            await self._send_result(decoded, image_output, options, started, emit)
        finally:
            req.leases.release_all()

    async def _call(
        self,
        req: _Request,
        replica: Replica,
        inputs: tensor_pb2.StageState,
        *,
        consumer: Replica | None,
        outputs: list[str] | None = None,
    ) -> tensor_pb2.StageState:
        """Run one stage; returns its output handles (their leases are booked in req.leases)."""
        consumer_host = consumer.info.host_id if consumer and consumer.info else self.transport.host_id
        request = stage_pb2.StageRequest(
            request_id=req.request_id,
            params=req.params,
            input=inputs,
            consumer_host_id=consumer_host,
            progress_every=req.options.progress_every,
            preview_every=req.options.preview_every,
            outputs=outputs or [],
        )
        timeout = req.timeout(self.stage_timeout_s)
        await req.emit(
            cpb.GenerateEvent(stage_started=cpb.StageStarted(stage=replica.stage, replica=replica.address))
        )
        started = time.perf_counter()
        result: stage_pb2.StageResult | None = None
        try:
            async for event in replica.stub.Run(request, timeout=timeout):
                if event.HasField("step"):
                    step = cpb.DenoiseStep(
                        step=event.step.step, total=event.step.total, preview_png=event.step.preview_png
                    )
                    await req.emit(cpb.GenerateEvent(step=step))
                elif event.HasField("result"):
                    result = event.result
                    req.leases.add(replica.address, result.output)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_failed(replica)
                raise Unavailable(
                    f"{replica.stage} replica {replica.address} is unavailable; retry the request"
                ) from None
            raise error_from_rpc(err) from None
        if result is None:
            raise OmniError(f"{replica.stage} at {replica.address} ended without a result")
        finished = cpb.StageFinished(
            stage=replica.stage,
            wall_ms=(time.perf_counter() - started) * 1e3,
            compute_ms=result.compute_ms,
        )
        await req.emit(cpb.GenerateEvent(stage_finished=finished))
        return result.output

    async def _send_result(
        self,
        decoded: tensor_pb2.StageState,
        image_output: str,
        options: cpb.GenerateRequest,
        started: float,
        emit: Emit,
    ) -> None:
        tensors, _ = await self.transport.import_state(decoded)
        result = cpb.Result(
            image=tensors[image_output].numpy().tobytes(),
            image_format=options.image_format,
            width=int(decoded.meta.get("width", "0")),
            height=int(decoded.meta.get("height", "0")),
        )
        if options.return_tensor:
            image = tensors["image"].contiguous()
            raw = image.view(-1).view(torch.uint8).numpy()
            for offset in range(0, raw.nbytes, CHUNK_BYTES):
                chunk = raw[offset : offset + CHUNK_BYTES].tobytes()
                await emit(cpb.GenerateEvent(raw_chunk=cpb.RawChunk(offset=offset, data=chunk)))
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
