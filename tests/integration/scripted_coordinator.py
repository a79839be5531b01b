"""A coordinator that speaks from a script: a real grpc.aio server on loopback with the
Coordinator service's contract (Accepted, TextDelta and AudioChunk events interleaved as a
streaming reply sends them, then Result; an unknown speaker refused once the request runs, as
the thinker refuses it), for the gateway's speech and chat tests where a real model is not the
point: what they pin is the HTTP translation of that stream. Every call it serves is counted
while open, so a test sees the gateway close it when its client leaves."""

from __future__ import annotations

import asyncio
import io

import grpc
import grpc.aio
import numpy as np
import torch
from PIL import Image

from omni_common.audio import encode_audio
from omni_common.errors import InvalidArgument
from omni_common.imaging import inspect_image, to_png
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import coordinator_pb2_grpc

MODEL = "qwen2.5-omni-scripted"
EDITOR = "image-editor-scripted"
SPEAKERS = ("Chelsie", "Ethan")
SAMPLE_RATE = 24_000
CHUNK_SAMPLES = 4_800  # 0.2 s


def reply_text(prompt: str, words: int) -> list[str]:
    """The scripted reply's text pieces: the prompt's words echoed, `words` of them."""
    source = prompt.split() or ["hm"]
    return [f"{source[i % len(source)]} " for i in range(words)]


def reply_audio(seed: int, chunks: int) -> np.ndarray:
    """The scripted reply's samples: a seeded tone, float32 in [-1, 1]."""
    t = np.arange(chunks * CHUNK_SAMPLES, dtype=np.float64) / SAMPLE_RATE
    return (0.8 * np.sin(2 * np.pi * (220 + seed) * t)).astype(np.float32)


def edited(image: bytes, seed: int) -> cpb.Result:
    """The scripted edit of an input image: its pixels inverted, then shifted by the seed."""
    pixels = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
    out = (255 - pixels.astype(np.int64) + seed) % 256
    height, width = out.shape[:2]
    return cpb.Result(image=to_png(out.astype(np.uint8)), width=width, height=height, kind="image")


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Text first, then audio chunks interleaved with the rest of the text (options: "words",
    "chunks"; "audio" 0 writes only)."""

    def __init__(self) -> None:
        self.open_calls = 0
        self.cancelled = 0
        self.gate: asyncio.Event | None = None  # set: a held reply may go on past its first audio

    async def Generate(self, request: cpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.open_calls += 1
        try:
            params = request.params
            if request.inputs:  # an edit: the inputs checked as the coordinator checks them
                for i, media in enumerate(request.inputs):
                    try:
                        inspect_image(media.image, index=i, max_pixels=1 << 22)
                    except InvalidArgument as err:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err.message)
            yield cpb.GenerateEvent(accepted=cpb.Accepted(request_id="scripted-1"))
            if request.inputs:
                yield cpb.GenerateEvent(result=edited(request.inputs[0].image, params.seed))
                return
            speaker = params.options.get("speaker", "Chelsie")
            if speaker not in SPEAKERS:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"unknown speaker {speaker[:50]!r}; this model has {', '.join(SPEAKERS)}",
                )
            speaks = params.options.get("audio", "1") == "1"
            text = reply_text(params.prompt, int(params.options.get("words", "6")))
            audio = reply_audio(params.seed, int(params.options.get("chunks", "3"))) if speaks else None
            sent = 0
            for i, piece in enumerate(text):
                yield cpb.GenerateEvent(text=cpb.TextDelta(step="thinker", text=piece))
                if audio is not None and i >= 1 and sent < len(audio):  # audio before the text ends
                    yield self._chunk(request, audio, sent)
                    sent += CHUNK_SAMPLES
                    if self.gate is not None:
                        await self.gate.wait()
            while audio is not None and sent < len(audio):
                yield self._chunk(request, audio, sent)
                sent += CHUNK_SAMPLES
            result = cpb.Result(kind="audio" if speaks else "text", text="".join(text))
            result.sample_rate = SAMPLE_RATE if speaks else 0
            result.audio_samples = sent
            yield cpb.GenerateEvent(result=result)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.open_calls -= 1

    @staticmethod
    def _chunk(request: cpb.GenerateRequest, audio: np.ndarray, offset: int) -> cpb.GenerateEvent:
        samples = torch.from_numpy(audio[offset : offset + CHUNK_SAMPLES])
        chunk = cpb.AudioChunk(
            index=offset // CHUNK_SAMPLES,
            sample_rate=SAMPLE_RATE,
            format=request.audio_format,
            data=encode_audio(samples, request.audio_format),
            offset=offset,
        )
        return cpb.GenerateEvent(audio=chunk)

    async def ListModels(self, request: cpb.ListModelsRequest, context: grpc.aio.ServicerContext):
        info = cpb.ModelInfo(
            name=MODEL, family="qwen2.5-omni", inputs=["text"], outputs=["text", "audio"], ready=True
        )
        info.options.add(name="speaker", type="str", default_value="Chelsie")
        # An image editor as well (the script inverts the input), for the page's edit tab.
        editor = cpb.ModelInfo(
            name=EDITOR,
            family="glm-image",
            inputs=["text", "image"],
            outputs=["image"],
            max_images=4,
            ready=True,
        )
        return cpb.ListModelsResponse(models=[info, editor])


async def serve_scripted(coordinator: ScriptedCoordinator) -> tuple[grpc.aio.Server, str]:
    """The scripted coordinator on a free loopback port (on the running loop)."""
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _serve_forever(port: int) -> None:
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(ScriptedCoordinator(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"scripted coordinator ready on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":  # for benchmarks/gateway.py --speech --coordinator (the gateway's cost alone)
    import sys

    asyncio.run(_serve_forever(int(sys.argv[1])))
