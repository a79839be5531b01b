"""The omnistage client SDK: what users import.

    from omni_common.client import Client

    with Client("127.0.0.1:50051") as client:
        image = client.generate("a red fox in snow", width=512, height=512, steps=20, seed=7)
        image.save("fox.png")

Models that take input images (GLM-Image edits) get them as `images=[...]` (PIL images, file
paths or encoded bytes); family options as `options={"name": value}` (ListModels says which):

        edited = client.generate("make the sky red", images=["photo.png"], model="glm-image")

Models that write and speak (Qwen2.5-Omni) answer `chat` (text and audio as they stream; see
omni_common.chat) and `speak` (the whole reply); they hear `audio=[...]`, see `images=[...]` and
videos as frames, `video=Video(frames, fps)` or `Video.open("clip.gif")` (omni_common.media):

        reply = client.speak("What happens here?", video=Video.open("clip.gif"))

`AsyncClient` has the same methods as coroutines / async iterators. Failures raise the
typed errors of omni_common.errors (InvalidArgument, NotFound, DeadlineExceeded, ...).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from PIL import Image

from omni_common.chat import ChatPiece, Messages, Reply, ReplyBuilder, chat_request
from omni_common.errors import OmniError, error_from_rpc
from omni_common.media import ImageLike, image_bytes
from omni_common.net.auth import API_KEY_HEADER
from omni_common.net.rpc import Metadata, aio_channel, sync_channel
from omni_common.net.tls import TlsSettings, client_settings
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import coordinator_pb2_grpc, stage_pb2

DEFAULT_ADDRESS = "127.0.0.1:50051"
LoraLike = str | tuple[str, float]


def lora_ref(lora: LoraLike) -> stage_pb2.LoraRef:
    """A LoRA adapter of a request: "name" (the scale it was added with) or ("name", scale)."""
    if isinstance(lora, str):
        return stage_pb2.LoraRef(name=lora)
    name, scale = lora
    return stage_pb2.LoraRef(name=name, scale=float(scale))


def generate_request(
    prompt: str,
    *,
    negative_prompt: str = "",
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    model: str = "",
    max_sequence_length: int = 512,
    request_id: str = "",
    return_tensor: bool = False,
    progress_every: int = 1,
    preview_every: int = 0,
    image_format: str = "rgb8",
    images: Sequence[ImageLike] = (),
    options: Mapping[str, object] | None = None,
    loras: Sequence[LoraLike] = (),
) -> cpb.GenerateRequest:
    """The GenerateRequest for these arguments (guidance is the model's guidance scale:
    diffusers' true_cfg_scale for Qwen-Image, guidance_scale for GLM-Image; width, height,
    steps and guidance left None take the model's own defaults, `omnistage models` lists them;
    image_format "rgb8" sends raw pixels, "png" a PNG file; loras names the
    DiT's LoRA adapters in order, each a name (its added scale) or (name, scale))."""
    formats = {"png": cpb.IMAGE_FORMAT_PNG, "rgb8": cpb.IMAGE_FORMAT_RGB8}
    if image_format not in formats:
        raise ValueError(f"image_format must be one of {sorted(formats)}, not {image_format!r}")
    params = stage_pb2.GenerationParams(
        model=model,
        prompt=prompt,
        negative_prompt=negative_prompt,
        width=width,
        height=height,
        num_inference_steps=steps,  # None leaves the field unset: the coordinator fills it
        seed=seed,
        max_sequence_length=max_sequence_length,
        options={name: str(value) for name, value in (options or {}).items()},
        loras=[lora_ref(lora) for lora in loras],
    )
    if guidance is not None:
        params.true_cfg_scale = guidance
    return cpb.GenerateRequest(
        params=params,
        request_id=request_id,
        return_tensor=return_tensor,
        progress_every=progress_every,
        preview_every=preview_every,
        image_format=formats[image_format],
        inputs=[cpb.InputMedia(image=image_bytes(image)) for image in images],
    )


@dataclass
class GenerationResult:
    """A finished generation: the image, its wire bytes (PNG file or raw RGB8), the float
    tensor if asked for, and timings."""

    image: Image.Image
    encoded: bytes
    request_id: str
    total_ms: float
    stage_ms: dict[str, float] = field(default_factory=dict)
    compute_ms: dict[str, float] = field(default_factory=dict)
    tensor: np.ndarray | None = None

    @property
    def overhead_ms(self) -> float:
        """Time not spent inside a stage's model code: RPCs, transport, queueing, PNG."""
        return self.total_ms - sum(self.compute_ms.values())


class ResultBuilder:
    """Folds a stream of GenerateEvents into a GenerationResult."""

    def __init__(self) -> None:
        self.request_id = ""
        self.stage_ms: dict[str, float] = {}
        self.compute_ms: dict[str, float] = {}
        self.raw = bytearray()
        self.result: cpb.Result | None = None

    def add(self, event: cpb.GenerateEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "accepted":
            self.request_id = event.accepted.request_id
        elif kind == "stage_finished":
            # Keyed by plan step ("encode", "prior", ...); a coordinator before plans sent stages.
            finished = event.stage_finished
            self.stage_ms[finished.step or finished.stage] = finished.wall_ms
            self.compute_ms[finished.step or finished.stage] = finished.compute_ms
        elif kind == "raw_chunk":
            if event.raw_chunk.offset != len(self.raw):
                raise OmniError("raw tensor chunks arrived out of order", grpc.StatusCode.DATA_LOSS)
            self.raw.extend(event.raw_chunk.data)
        elif kind == "result":
            self.result = event.result

    def build(self) -> GenerationResult:
        if self.result is None:
            raise OmniError("the stream ended without a result", grpc.StatusCode.DATA_LOSS)
        encoded = self.result.image
        if self.result.image_format == cpb.IMAGE_FORMAT_RGB8:
            size = (self.result.width, self.result.height)
            if len(encoded) != size[0] * size[1] * 3:
                raise OmniError("raw image has the wrong size", grpc.StatusCode.DATA_LOSS)
            image = Image.frombytes("RGB", size, encoded)
        else:
            image = Image.open(io.BytesIO(encoded))
            image.load()
        tensor = None
        if self.result.HasField("tensor"):
            ref = self.result.tensor
            if len(self.raw) != ref.nbytes:
                raise OmniError("raw tensor is incomplete", grpc.StatusCode.DATA_LOSS)
            tensor = np.frombuffer(bytes(self.raw), dtype=np.dtype(ref.dtype)).reshape(tuple(ref.shape))
        return GenerationResult(
            image=image,
            encoded=encoded,
            request_id=self.request_id,
            total_ms=self.result.total_ms,
            stage_ms=self.stage_ms,
            compute_ms=self.compute_ms,
            tensor=tensor,
        )


def _api_key_metadata(api_key: str | None) -> Metadata:
    key = os.environ.get("OMNISTAGE_API_KEY", "") if api_key is None else api_key
    return ((API_KEY_HEADER, key),) if key else ()


class _Connection:
    """What both clients hold: the coordinator's address, the default timeout, a stub on a
    channel that sends the API key and verifies TLS."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float | None = 600.0,
        api_key: str | None = None,
        ca_cert: str | Path | None = None,
        server_name: str = "",
    ) -> None:
        """`api_key`: for a coordinator that requires one (default: OMNISTAGE_API_KEY).
        `ca_cert`: a CA bundle (PEM file) to verify the coordinator's TLS certificate against
        (default: OMNISTAGE_TLS_CA; neither: plaintext); `server_name`: the name to check in
        it instead of the address's host (default: OMNISTAGE_TLS_SERVER_NAME)."""
        self.address = address
        self.timeout = timeout
        tls = client_settings(ca_cert, server_name)
        self._channel = self._open(address, _api_key_metadata(api_key), tls)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def _open(self, address: str, metadata: Metadata, tls: TlsSettings) -> Any:
        raise NotImplementedError


class Client(_Connection):
    """Blocking client of the coordinator."""

    def _open(self, address: str, metadata: Metadata, tls: TlsSettings) -> grpc.Channel:
        return sync_channel(address, metadata=metadata, tls=tls)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 60.0, model: str = "") -> None:
        """Block until the coordinator answers and can serve a request of `model` ("" = any)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if any(m.ready and model in ("", m.name) for m in self.list_models()):
                    return
            except OmniError:
                pass
            if time.monotonic() > deadline:
                what = f"model {model!r}" if model else "no model"
                raise OmniError(
                    f"{what} not ready at {self.address} after {timeout:g} s", grpc.StatusCode.UNAVAILABLE
                )
            time.sleep(0.2)

    def events(
        self, prompt: str, *, timeout: float | None = None, **kwargs: object
    ) -> Iterator[cpb.GenerateEvent]:
        """Stream the GenerateEvents of one request (kwargs as in `generate_request`)."""
        yield from self.stream(generate_request(prompt, **kwargs), timeout)  # type: ignore[arg-type]

    def stream(
        self, request: cpb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[cpb.GenerateEvent]:
        """The GenerateEvents of a prepared request."""
        call = self._stub.Generate(request, timeout=timeout or self.timeout)
        try:
            yield from call
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        finally:
            call.cancel()

    def chat(
        self, prompt: str | Messages, *, timeout: float | None = None, **kwargs: object
    ) -> Iterator[ChatPiece]:
        """The reply to `prompt` (or to a conversation's messages) as it streams: TextDelta and
        SpeechChunk pieces (kwargs as in omni_common.chat.chat_request: audio (input clips),
        images, video, speak, speaker, model, seed, ...)."""
        builder = ReplyBuilder(time.perf_counter())
        for event in self.stream(chat_request(prompt, **kwargs), timeout):  # type: ignore[arg-type]
            piece = builder.add(event, time.perf_counter())
            if piece is not None:
                yield piece

    def speak(self, prompt: str | Messages, *, timeout: float | None = None, **kwargs: object) -> Reply:
        """The whole reply to `prompt`: text, audio and timings (kwargs as in `chat`)."""
        builder = ReplyBuilder(time.perf_counter())
        for event in self.stream(chat_request(prompt, **kwargs), timeout):  # type: ignore[arg-type]
            builder.add(event, time.perf_counter())
        return builder.build()

    def generate_result(self, prompt: str, **kwargs: object) -> GenerationResult:
        builder = ResultBuilder()
        for event in self.events(prompt, **kwargs):  # type: ignore[arg-type]
            builder.add(event)
        return builder.build()

    def generate(
        self,
        prompt: str,
        negative_prompt: str = "",
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        seed: int = 0,
        **kwargs: object,
    ) -> Image.Image:
        """Generate one image and return it as a PIL image (kwargs as in `generate_request`:
        model, images, options, ...)."""
        return self.generate_result(
            prompt,
            negative_prompt=negative_prompt,
            width=width,
            height=height,
            steps=steps,
            guidance=guidance,
            seed=seed,
            **kwargs,
        ).image

    def cancel(self, request_id: str) -> bool:
        """True when the request was in flight and is now being cancelled; False when no
        request of this key has that id in flight (the server says NOT_FOUND)."""
        try:
            return bool(self._stub.Cancel(cpb.CancelRequest(request_id=request_id), timeout=10).cancelled)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise error_from_rpc(err) from None

    def list_models(self) -> list[cpb.ModelInfo]:
        try:
            return list(self._stub.ListModels(cpb.ListModelsRequest(), timeout=10).models)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None


class AsyncClient(_Connection):
    """asyncio client of the coordinator; the same methods as Client, awaited."""

    def _open(self, address: str, metadata: Metadata, tls: TlsSettings) -> grpc.aio.Channel:
        return aio_channel(address, metadata=metadata, tls=tls)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def events(
        self, prompt: str, *, timeout: float | None = None, **kwargs: object
    ) -> AsyncIterator[cpb.GenerateEvent]:
        async for event in self.stream(generate_request(prompt, **kwargs), timeout):  # type: ignore[arg-type]
            yield event

    async def stream(
        self, request: cpb.GenerateRequest, timeout: float | None, metadata: Metadata = ()
    ) -> AsyncIterator[cpb.GenerateEvent]:
        """The GenerateEvents of a prepared request; `metadata` goes with this call only (a
        gateway forwards each caller's own API key)."""
        call = self._stub.Generate(request, timeout=timeout or self.timeout, metadata=metadata or None)
        try:
            async for event in call:
                yield event
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        finally:
            call.cancel()

    async def chat(
        self, prompt: str | Messages, *, timeout: float | None = None, **kwargs: object
    ) -> AsyncIterator[ChatPiece]:
        builder = ReplyBuilder(time.perf_counter())
        async for event in self.stream(chat_request(prompt, **kwargs), timeout):  # type: ignore[arg-type]
            piece = builder.add(event, time.perf_counter())
            if piece is not None:
                yield piece

    async def speak(self, prompt: str | Messages, *, timeout: float | None = None, **kwargs: object) -> Reply:
        builder = ReplyBuilder(time.perf_counter())
        async for event in self.stream(chat_request(prompt, **kwargs), timeout):  # type: ignore[arg-type]
            builder.add(event, time.perf_counter())
        return builder.build()

    async def generate_result(self, prompt: str, **kwargs: object) -> GenerationResult:
        builder = ResultBuilder()
        async for event in self.events(prompt, **kwargs):  # type: ignore[arg-type]
            builder.add(event)
        return builder.build()

    async def generate(
        self,
        prompt: str,
        negative_prompt: str = "",
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        seed: int = 0,
        **kwargs: object,
    ) -> Image.Image:
        result = await self.generate_result(
            prompt,
            negative_prompt=negative_prompt,
            width=width,
            height=height,
            steps=steps,
            guidance=guidance,
            seed=seed,
            **kwargs,
        )
        return result.image

    async def cancel(self, request_id: str) -> bool:
        try:
            response = await self._stub.Cancel(cpb.CancelRequest(request_id=request_id), timeout=10)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # none of this key's: as the sync cancel
                return False
            raise error_from_rpc(err) from None
        return bool(response.cancelled)

    async def list_models(self, metadata: Metadata = ()) -> list[cpb.ModelInfo]:
        try:
            response = await self._stub.ListModels(
                cpb.ListModelsRequest(), timeout=10, metadata=metadata or None
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return list(response.models)
