"""A family whose last role returns its whole waveform as one tensor (a vocoder that does not
stream) still delivers it: the coordinator sends it as AudioChunk events before the Result,
whose audio_samples counts them, instead of a silent reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch

from omni_common.audio import decode_audio
from omni_common.models.base import Plan, PlanStep
from omni_common.runtime.rpc import CHUNK_BYTES
from omni_common.transport import TensorTransport, encode_inline
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import stage_pb2, tensor_pb2
from services.coordinator.flow import RequestFlow
from services.coordinator.registry import Replica, ReplicaPool

# One step, as a text-to-speech family's vocoder would be: the result is the waveform.
PLAN = Plan((PlanStep("vocoder", "vae-decode", "vocoder", produces=("audio",)),))


class OneShotVocoder:
    """A stage whose Run returns `samples` as its result's "audio" tensor, all at once."""

    def __init__(self, samples: torch.Tensor) -> None:
        self.samples = samples

    def Run(
        self, request: stage_pb2.StageRequest, timeout: float | None = None
    ) -> AsyncIterator[stage_pb2.StageEvent]:
        async def events() -> AsyncIterator[stage_pb2.StageEvent]:
            audio = encode_inline("audio", self.samples)
            output = tensor_pb2.StageState(tensors=[audio], meta={"sample_rate": "16000"})
            yield stage_pb2.StageEvent(result=stage_pb2.StageResult(output=output))

        return events()


def reply_events(samples: torch.Tensor, audio_format: int, tmp_path: Path) -> list[cpb.GenerateEvent]:
    pool = ReplicaPool()
    info = stage_pb2.StageInfo(stage="vae-decode", model="m", host_id="h1", address="v:1")
    pool.replicas["vae-decode"] = [Replica("vae-decode", info.address, OneShotVocoder(samples), info=info)]  # type: ignore[arg-type]
    transport = TensorTransport(shm_dir=tmp_path)
    sent: list[cpb.GenerateEvent] = []

    async def emit(event: cpb.GenerateEvent) -> None:
        sent.append(event)

    try:
        flow = RequestFlow(pool, transport, stage_timeout_s=10)
        options = cpb.GenerateRequest(audio_format=audio_format)
        asyncio.run(flow.run("r1", stage_pb2.GenerationParams(model="m"), options, PLAN, None, emit))
    finally:
        transport.close()
    return sent


def test_a_vocoder_that_returns_one_tensor_is_heard_not_silent(tmp_path: Path) -> None:
    samples = torch.linspace(-1, 1, 1000)
    events = reply_events(samples, cpb.AUDIO_FORMAT_FLOAT32, tmp_path)
    chunks = [e.audio for e in events if e.HasField("audio")]
    (result,) = [e.result for e in events if e.HasField("result")]
    assert events[-1].HasField("result")
    assert result.kind == "audio" and result.sample_rate == 16000 and result.audio_samples == 1000
    assert [c.index for c in chunks] == [0] and chunks[0].sample_rate == 16000
    np.testing.assert_array_equal(decode_audio(chunks[0].data, chunks[0].format), samples.numpy())


def test_a_long_one_shot_waveform_travels_in_chunks_within_the_message_limits(tmp_path: Path) -> None:
    samples = torch.rand(CHUNK_BYTES // 4 * 2 + 5) * 2 - 1
    events = reply_events(samples, cpb.AUDIO_FORMAT_PCM16, tmp_path)
    chunks = [e.audio for e in events if e.HasField("audio")]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert [c.offset for c in chunks] == [0, CHUNK_BYTES // 4, CHUNK_BYTES // 2]
    heard = np.concatenate([decode_audio(c.data, c.format) for c in chunks])
    np.testing.assert_allclose(heard, samples.numpy(), atol=0.5 / 32767 + 1e-7)
    assert events[-1].result.audio_samples == samples.numel()
