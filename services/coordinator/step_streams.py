"""Streams between plan steps: a step's partial outputs (StepProgress.partial), in order, and
the feeding of them to a consumer step that takes them as a stream (PlanStep.streamed).

The coordinator keeps every chunk of a stream until the request ends (chunks are small: a
token's hidden state, a few codes, a window of mel frames), so that a consumer that restarts
on another replica is fed the stream again from its start, and a producer that restarts
(seeded, so it makes the same chunks) is not heard twice: a chunk index already held is
dropped. A chunk above the inline threshold (a real-size prompt's rows) is copied into the
coordinator's own store as it arrives (as checkpoints are): a consumer restarted after its
producer died can still read it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

log = logging.getLogger("omnistage.coordinator")


class Stream:
    """The chunks a streaming step has sent so far, and whether it finished."""

    def __init__(self) -> None:
        self.chunks: list[tensor_pb2.StageState] = []
        self.ended = False
        self.error: BaseException | None = None
        self.producer = ""  # the address of the replica that sent the latest chunk
        self._changed = asyncio.Event()

    def fresh(self, chunk: tensor_pb2.StageState) -> bool:
        """Whether `chunk` is the next one (not a repeat of one held, the stream not ended)."""
        index = int(chunk.meta.get("chunk", str(len(self.chunks))))
        return index == len(self.chunks) and not self.ended

    def push(self, chunk: tensor_pb2.StageState) -> bool:
        """Add the next chunk; False (and nothing added) for one already held."""
        if not self.fresh(chunk):
            return False
        self.chunks.append(chunk)
        self._notify()
        return True

    def end(self) -> None:
        self.ended = True
        self._notify()

    def fail(self, error: BaseException) -> None:
        """The producer failed for good: consumers waiting for chunks fail with it."""
        self.error = error
        self._notify()

    async def wait(self, count: int) -> bool:
        """Until `count` chunks exist (True) or the stream ended with fewer (False)."""
        while len(self.chunks) < count:
            if self.error is not None:
                raise self.error
            if self.ended:
                return False
            changed = self._changed
            await changed.wait()
        return True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


async def feed(
    stub: stage_pb2_grpc.StageStub, request_id: str, role: str, stream: Stream, *, timeout: float | None
) -> None:
    """Send `stream`'s chunks from index 1 on (chunk 0 went with the Run call) to a consumer's
    streaming call, then the end. Stops quietly when the call is gone: the Run call's own
    status says why."""
    index = 1
    try:
        while True:
            more = await stream.wait(index + 1)
            if not more:
                end = stage_pb2.FeedRequest(request_id=request_id, role=role, index=index, end=True)
                await stub.Feed(end, timeout=timeout)
                return
            chunk = stage_pb2.FeedRequest(
                request_id=request_id, role=role, index=index, chunk=stream.chunks[index]
            )
            await stub.Feed(chunk, timeout=timeout)
            index += 1
    except grpc.RpcError as err:
        log.info("request %s: feeding %s stopped: %s", request_id, role, err.code().name)
