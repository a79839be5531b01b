"""A request's result as the client gets it, from its plan's result step: an image (PNG or
RGB8 bytes, with the raw tensor in chunks when asked), or a reply (its text and its audio as
AudioChunks). A reply's chunks mostly went out while its steps ran (flow.py's partials); a
last role that does not stream returns its whole waveform, sent here as the last chunks."""

from __future__ import annotations

import time

import torch

from omni_common.audio import encode_audio
from omni_common.models.base import PlanStep
from omni_common.net.rpc import CHUNK_BYTES
from omni_common.transport import TensorTransport
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import tensor_pb2
from services.coordinator.request import FlowRequest


def result_outputs(options: cpb.GenerateRequest) -> list[str]:
    """What the result step returns: the image in the client's format (+ the raw tensor)."""
    image = "rgb8" if options.image_format == cpb.IMAGE_FORMAT_RGB8 else "png"
    return [image, "image"] if options.return_tensor else [image]


async def send_audio(req: FlowRequest, samples: torch.Tensor, meta: dict[str, str]) -> None:
    """The next AudioChunk of the reply: `samples` (flat float32) in the client's format."""
    chunk = cpb.AudioChunk(
        index=req.audio_chunks,
        sample_rate=int(meta.get("sample_rate", "0")),
        format=req.options.audio_format,
        data=encode_audio(samples, req.options.audio_format),
        offset=req.audio_samples,
    )
    req.audio_chunks += 1
    req.audio_samples += samples.numel()
    await req.emit(cpb.GenerateEvent(audio=chunk))


async def send_result(
    transport: TensorTransport,
    req: FlowRequest,
    step: PlanStep,
    decoded: tensor_pb2.StageState,
    started: float,
) -> None:
    """The Result event of `req` from its result step's output `decoded` (handles), after the
    raw chunks or audio chunks that go before it; `started`: time.perf_counter() at its start."""
    if "image" in step.produces:
        result = await _image_result(transport, req, decoded)
    else:
        result = await _reply_result(transport, req, step, decoded)
    result.total_ms = (time.perf_counter() - started) * 1e3
    await req.emit(cpb.GenerateEvent(result=result))


async def _reply_result(
    transport: TensorTransport, req: FlowRequest, step: PlanStep, decoded: tensor_pb2.StageState
) -> cpb.Result:
    """A reply: its text and audio went out in chunks, but for a last role that does not stream
    (a vocoder returning one tensor): its result holds the whole waveform, sent as the reply's
    last chunks. (A streaming one returns no "audio": its chunks went out as partials.)"""
    kind = "audio" if "audio" in step.produces else "text"
    if kind == "audio" and "audio" in (ref.name for ref in decoded.tensors):
        tensors, meta = await transport.import_state(decoded)
        samples = tensors["audio"].to(torch.float32).view(-1)
        per_chunk = CHUNK_BYTES // 4  # float32: each event within the message limits
        for start in range(0, max(1, samples.numel()), per_chunk):
            await send_audio(req, samples[start : start + per_chunk].clone(), meta)
    result = cpb.Result(kind=kind, text="".join(req.text), audio_samples=req.audio_samples)
    result.sample_rate = int(decoded.meta.get("sample_rate", "0"))
    return result


async def _image_result(
    transport: TensorTransport, req: FlowRequest, decoded: tensor_pb2.StageState
) -> cpb.Result:
    """An image in the client's format; with `return_tensor`, the raw tensor goes first as
    RawChunk events and the result describes it."""
    options = req.options
    tensors, _ = await transport.import_state(decoded)
    result = cpb.Result(
        image=tensors[result_outputs(options)[0]].numpy().tobytes(),
        image_format=options.image_format,
        width=int(decoded.meta.get("width", "0")),
        height=int(decoded.meta.get("height", "0")),
        kind="image",
    )
    if options.return_tensor:
        image = tensors["image"].contiguous()
        raw = image.view(-1).view(torch.uint8).numpy()
        for offset in range(0, raw.nbytes, CHUNK_BYTES):
            chunk = raw[offset : offset + CHUNK_BYTES].tobytes()
            await req.emit(cpb.GenerateEvent(raw_chunk=cpb.RawChunk(offset=offset, data=chunk)))
        result.tensor.CopyFrom(
            tensor_pb2.TensorRef(
                name="image",
                dtype=str(image.dtype).removeprefix("torch."),
                shape=list(image.shape),
                nbytes=raw.nbytes,
            )
        )
    return result
