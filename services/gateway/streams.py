"""The coordinator's event streams of one HTTP request, `n` images each its own Generate
call: their first events (the coordinator's yes or no), the images folded from them, or the
SSE body that interleaves them. The first failure of any image cancels the others."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from omni_common.errors import InvalidArgument, OmniError
from omnistage.v1 import coordinator_pb2 as cpb
from services.gateway.protocol import SSE_DONE, error_body, image_item, sse

Events = AsyncIterator[cpb.GenerateEvent]
T = TypeVar("T")


class ImageEvents:
    """Folds one image's GenerateEvents: its result and per-step wall times."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.timings: dict[str, float] = {}
        self.result: cpb.Result | None = None

    def add(self, event: cpb.GenerateEvent) -> None:
        """Take in the next event of the image's stream."""
        if event.HasField("stage_finished"):
            finished = event.stage_finished
            self.timings[finished.step or finished.stage] = round(finished.wall_ms, 3)
        elif event.HasField("result"):
            self.result = event.result

    def item(self) -> dict[str, Any]:
        """The image's entry of the response's `data` (once its Result came)."""
        if self.result is None:
            raise OmniError("the coordinator's stream ended without a result", grpc.StatusCode.DATA_LOSS)
        if self.result.kind not in ("", "image"):  # a model that speaks or writes
            raise InvalidArgument(
                f"this model answers with {self.result.kind}, not an image; "
                "/v1/images/generations serves image models"
            )
        return image_item(self.result, self.seed, self.timings)


async def gather_or_cancel(work: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of `work`, run at once; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(call: Events) -> cpb.GenerateEvent:
    async for event in call:
        return event
    raise OmniError("the coordinator's stream ended at once", grpc.StatusCode.DATA_LOSS)


async def first_events(calls: list[Events]) -> list[cpb.GenerateEvent]:
    """Every call's first event, at once; on any failure every call is closed (cancelled)."""
    try:
        return await gather_or_cancel([_first(call) for call in calls])
    except BaseException:
        await close(calls)
        raise


async def close(calls: list[Events]) -> None:
    """End every call (a call still running is cancelled at the coordinator)."""
    for call in calls:
        with contextlib.suppress(Exception):
            await call.aclose()  # type: ignore[attr-defined]


async def collect(
    calls: list[Events], firsts: list[cpb.GenerateEvent], seeds: list[int]
) -> list[dict[str, Any]]:
    """Every image of a request (non-streamed), in order."""

    async def one(call: Events, first: cpb.GenerateEvent, seed: int) -> dict[str, Any]:
        image = ImageEvents(seed)
        image.add(first)
        async for event in call:
            image.add(event)
        return image.item()

    try:
        return await gather_or_cancel([one(c, f, s) for c, f, s in zip(calls, firsts, seeds, strict=True)])
    finally:
        await close(calls)


async def sse_body(
    calls: list[Events], firsts: list[cpb.GenerateEvent], seeds: list[int]
) -> AsyncIterator[bytes]:
    """The SSE body: each image's step, preview and stage events as they come (`index` says
    which image), its `image_generation.completed` event, then `[DONE]`; a failure is an
    `error` event and ends the stream."""
    queue: asyncio.Queue[tuple[int, cpb.GenerateEvent | OmniError | None]] = asyncio.Queue()

    async def pump(index: int, call: Events) -> None:
        try:
            async for event in call:
                await queue.put((index, event))
        except OmniError as err:
            await queue.put((index, err))
        finally:
            await queue.put((index, None))

    images = [ImageEvents(seed) for seed in seeds]
    for image, first in zip(images, firsts, strict=True):
        image.add(first)
    pumps = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    previews = [0] * len(calls)
    try:
        open_calls = len(calls)
        while open_calls:
            index, event = await queue.get()
            if event is None:
                open_calls -= 1
                continue
            if isinstance(event, OmniError):
                _, body, _ = error_body(event)
                yield sse({"type": "error", "index": index, **body})
                return
            images[index].add(event)
            for payload in _payloads(index, event, images[index], previews):
                yield sse(payload)
        yield SSE_DONE
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await close(calls)


def _payloads(
    index: int, event: cpb.GenerateEvent, image: ImageEvents, previews: list[int]
) -> list[dict[str, Any]]:
    """The SSE payloads of one coordinator event."""
    kind = event.WhichOneof("event")
    if kind == "step":
        step = event.step
        out: list[dict[str, Any]] = [
            {"type": "image_generation.step", "index": index, "step": step.step, "total": step.total}
        ]
        if step.preview_png:
            out.append(
                {
                    "type": "image_generation.partial_image",
                    "index": index,
                    "partial_image_index": previews[index],
                    "step": step.step,
                    "b64_json": base64.b64encode(step.preview_png).decode(),
                    "output_format": "png",
                }
            )
            previews[index] += 1
        return out
    if kind == "stage_started":
        started = event.stage_started
        return [
            {
                "type": "image_generation.stage_started",
                "index": index,
                "step": started.step,
                "stage": started.stage,
            }
        ]
    if kind == "stage_finished":
        finished = event.stage_finished
        return [
            {
                "type": "image_generation.stage_finished",
                "index": index,
                "step": finished.step or finished.stage,
                "stage": finished.stage,
                "wall_ms": round(finished.wall_ms, 3),
                "compute_ms": round(finished.compute_ms, 3),
            }
        ]
    if kind == "waiting":
        waiting = event.waiting
        return [
            {
                "type": "image_generation.waiting",
                "index": index,
                "stage": waiting.stage,
                "max_wait_ms": waiting.max_wait_ms,
            }
        ]
    if kind == "result":
        item = image.item()
        return [{"type": "image_generation.completed", "index": index, "output_format": "png", **item}]
    return []
