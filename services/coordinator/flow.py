"""One request through the stages: encode -> denoise -> decode, handles only.

Reads like the diffusers pipeline's __call__, with each model call replaced by a call to the
least-loaded replica of its stage. Stage outputs stay in the producing stage's arena; this
code passes their handles on and releases the leases once the next stage has consumed them,
and everything of a request that fails or is cancelled.

Replicas may die. An encoder or VAE call is retried on another replica. The DiT sends a
checkpoint (latents + step index) every few steps; if its replica dies, the request
resumes on another one from the latest checkpoint (or from the start if that checkpoint is
gone), and the image equals the uninterrupted one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

import grpc
import torch

from omni_common.errors import DeadlineExceeded, NotFound, OmniError, Unavailable, error_from_rpc
from omni_common.runtime.rpc import CHUNK_BYTES
from omni_common.transport import Consumer, TensorTransport, release_remote, sweep_stale_segments
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.offload import SwapPolicy
from services.coordinator.registry import Replica, ReplicaPool

log = logging.getLogger("omnistage.coordinator")

Emit = Callable[[cpb.GenerateEvent], Awaitable[None]]
ATTEMPTS = 3  # replicas tried per stage before the request fails


class ReplicaLost(Unavailable):
    """The replica went away mid-call (killed, crashed, draining)."""


class Leases:
    """Leases a request holds, per producer address.

    Releases run in the background: they free memory but nothing waits on them, so they
    stay off the request's critical path. A producer that is gone cannot release; its
    segments are swept here (same host) once its leases are no longer needed.
    """

    _pending: ClassVar[set[asyncio.Task[None]]] = set()

    def __init__(self, transport: TensorTransport) -> None:
        self.transport = transport
        self.held: dict[str, list[str]] = {}

    def add(self, producer: str, state: tensor_pb2.StageState) -> None:
        self.held.setdefault(producer, []).extend(self.transport.lease_ids(state))

    def drop(self, producer: str, state: tensor_pb2.StageState) -> None:
        """Release the leases of one state (e.g. a superseded checkpoint)."""
        ids = set(self.transport.lease_ids(state))
        held = self.held.get(producer, [])
        self.held[producer] = [i for i in held if i not in ids]
        self._spawn(producer, sorted(ids))

    def release(self, producer: str) -> None:
        self._spawn(producer, self.held.pop(producer, []))

    def release_all(self) -> None:
        for producer in list(self.held):
            self.release(producer)

    def _spawn(self, producer: str, lease_ids: list[str]) -> None:
        if lease_ids:
            task = asyncio.get_running_loop().create_task(self._release(producer, lease_ids))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _release(self, producer: str, lease_ids: list[str]) -> None:
        try:
            await release_remote(producer, lease_ids)
        except Exception as err:
            log.warning("could not release %d leases at %s (%s)", len(lease_ids), producer, err)
            # A dead producer on this host leaves its segments behind: sweep them.
            sweep_stale_segments(self.transport.shm_dir)


@dataclass
class _Request:
    """What every stage call of one request shares."""

    request_id: str
    params: stage_pb2.GenerationParams
    options: cpb.GenerateRequest
    deadline: float | None  # time.monotonic()
    emit: Emit
    leases: Leases
    # The DiT's latest checkpoint and the replica that holds it.
    checkpoint: tuple[str, tensor_pb2.StageState] | None = None
    failovers: list[str] = field(default_factory=list)

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

    def __init__(
        self,
        pool: ReplicaPool,
        transport: TensorTransport,
        stage_timeout_s: float,
        checkpoint_every: int = 5,
        offload: SwapPolicy | None = None,
    ) -> None:
        self.pool = pool
        self.offload = offload
        self.transport = transport
        self.stage_timeout_s = stage_timeout_s
        self.checkpoint_every = checkpoint_every

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
        image_output = "rgb8" if options.image_format == cpb.IMAGE_FORMAT_RGB8 else "png"
        outputs = [image_output, "image"] if options.return_tensor else [image_output]
        try:
            embeds, encoder = await self._stage(
                req, "ar-encoder", tensor_pb2.StageState(), then="dit-denoise"
            )
            latents, denoiser = await self._stage(req, "dit-denoise", embeds, near=encoder, then="vae-decode")
            req.leases.release(encoder.address)
            decoded, _ = await self._stage(req, "vae-decode", latents, near=denoiser, outputs=outputs)
            req.leases.release(denoiser.address)
            await self._send_result(decoded, image_output, options, started, emit)
        finally:
            req.leases.release_all()

    async def _stage(
        self,
        req: _Request,
        stage: str,
        inputs: tensor_pb2.StageState,
        *,
        near: Replica | None = None,
        then: str = "",
        outputs: list[str] | None = None,
    ) -> tuple[tensor_pb2.StageState, Replica]:
        """Run `stage` on its best replica (near the inputs), moving on when one is lost.
        The output's handles suit `then`'s likely replica (CUDA IPC on its GPU, shm on its
        host, else fetch); without `then`, this process, which has no GPU, consumes it."""
        near_host = near.info.host_id if near is not None and near.info is not None else ""
        tried: set[str] = set()
        for _ in range(ATTEMPTS):
            replica = self.pool.pick(stage, req.params.model, near_host=near_host, avoid=frozenset(tried))
            consumer = Consumer(self.transport.host_id)
            if then:
                assert replica.info is not None
                info = self.pool.pick(then, req.params.model, near_host=replica.info.host_id).info
                if info is not None:
                    consumer = Consumer(info.host_id, info.ipc_namespace, info.gpu_uuid)
            try:
                return await self._call(req, replica, inputs, consumer, outputs=outputs), replica
            except ReplicaLost as lost:
                tried.add(replica.address)
                req.failovers.append(replica.address)
                log.warning("request %s: %s; moving on", req.request_id, lost.message)
            except NotFound:
                if req.checkpoint is None or stage != "dit-denoise":
                    raise
                log.warning("request %s: checkpoint gone; restarting denoising", req.request_id)
                req.checkpoint = None
        raise Unavailable(f"request {req.request_id}: no {stage} replica could finish it; retry later")

    async def _call(
        self,
        req: _Request,
        replica: Replica,
        inputs: tensor_pb2.StageState,
        consumer: Consumer,
        *,
        outputs: list[str] | None = None,
    ) -> tensor_pb2.StageState:
        """Run one stage call; returns its output handles (their leases are booked in req.leases)."""
        request = stage_pb2.StageRequest(
            request_id=req.request_id,
            params=req.params,
            input=inputs,
            consumer_host_id=consumer.host_id,
            consumer_gpu_uuid=consumer.gpu_uuid,
            consumer_ipc_namespace=consumer.ipc_namespace,
            progress_every=req.options.progress_every,
            preview_every=req.options.preview_every,
            outputs=outputs or [],
        )
        if replica.stage == "dit-denoise":
            # Checkpoints serve failover: without another replica to resume on they only cost.
            if len(self.pool.serving("dit-denoise", req.params.model)) > 1:
                request.checkpoint_every = self.checkpoint_every
            if req.checkpoint is not None:
                request.resume.CopyFrom(req.checkpoint[1])
        timeout = req.timeout(self.stage_timeout_s)
        await req.emit(
            cpb.GenerateEvent(stage_started=cpb.StageStarted(stage=replica.stage, replica=replica.address))
        )
        started = time.perf_counter()
        result: stage_pb2.StageResult | None = None
        replica.in_flight += 1
        try:
            async with self.offload.turn(replica) if self.offload else contextlib.nullcontext():
                async for event in replica.stub.Run(request, timeout=timeout):
                    if event.HasField("step"):
                        await self._on_step(req, replica, event.step)
                    elif event.HasField("result"):
                        result = event.result
                        req.leases.add(replica.address, result.output)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) and _connection_lost(
                err
            ):
                self.pool.mark_failed(replica)
                raise ReplicaLost(f"{replica.stage} replica {replica.address} was lost") from None
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_failed(replica)
                raise ReplicaLost(f"{replica.stage} replica {replica.address} is unavailable") from None
            raise error_from_rpc(err) from None
        finally:
            replica.in_flight -= 1
        if result is None:
            raise OmniError(f"{replica.stage} at {replica.address} ended without a result")
        finished = cpb.StageFinished(
            stage=replica.stage,
            wall_ms=(time.perf_counter() - started) * 1e3,
            compute_ms=result.compute_ms,
        )
        await req.emit(cpb.GenerateEvent(stage_finished=finished))
        return result.output

    async def _on_step(self, req: _Request, replica: Replica, step: stage_pb2.StepProgress) -> None:
        if step.HasField("checkpoint"):
            req.leases.add(replica.address, step.checkpoint)
            if req.checkpoint is not None:
                req.leases.drop(*req.checkpoint)
            req.checkpoint = (replica.address, step.checkpoint)
        if step.step % max(req.options.progress_every, 1) == 0 or step.step == step.total:
            event = cpb.DenoiseStep(step=step.step, total=step.total, preview_png=step.preview_png)
            await req.emit(cpb.GenerateEvent(step=event))

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


def _connection_lost(err: grpc.RpcError) -> bool:
    """A call that broke because the peer went away (not a status the peer chose)."""
    details = (err.details() or "").lower()
    return any(
        word in details for word in ("socket closed", "connection reset", "rst_stream", "goaway", "connect")
    )
