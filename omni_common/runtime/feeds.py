"""The input streams of a stage's streaming calls (StageRequest.streaming + Stage.Feed).

A streaming Run call opens an `Inbox` under (request id, role) before anything else; Feed
calls put chunks into it. A Feed that arrives before its Run (the two are separate RPCs and
may be served in either order) waits a few seconds for the inbox to open, then gets
NOT_FOUND: nothing is kept for a call that never comes, and a call that ended takes its inbox
with it. Chunks are handed on in index order, each once: a producer that restarted sends its
chunks again and the repeats are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from omni_common.errors import InvalidArgument, NotFound, ResourceExhausted
from omni_common.models.base import StageState

OPEN_WAIT_S = 5.0  # how long a Feed waits for its Run call to open the inbox
MAX_AHEAD = 256  # chunks an inbox holds beyond the next one it expects


@dataclass(frozen=True)
class Chunk:
    """One input chunk: its tensors (already imported) and whether it is the last."""

    state: StageState
    end: bool


class Inbox:
    """The chunks of one streaming call, from index 1 on (chunk 0 came with the call)."""

    def __init__(self) -> None:
        self._next = 1
        self._waiting: dict[int, Chunk] = {}
        self._ready: asyncio.Queue[Chunk] = asyncio.Queue()
        self.ended = False
        self.imported: list[torch.Tensor] = []  # the chunks' tensors (finish_imports at the end)

    def put(self, index: int, chunk: Chunk) -> None:
        if index < self._next or index in self._waiting or self.ended:
            return  # a repeat (chunk 0 came with the call)
        if index - self._next >= MAX_AHEAD:
            raise InvalidArgument(f"chunk {index} is out of range: the call expects chunk {self._next} next")
        if len(self._waiting) >= MAX_AHEAD:
            raise ResourceExhausted("too many chunks wait for this call; send them in order")
        self._waiting[index] = chunk
        while self._next in self._waiting:
            ready = self._waiting.pop(self._next)
            self._next += 1
            self._ready.put_nowait(ready)
            if ready.end:
                self.ended = True
                self._waiting.clear()
                break

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The chunks in order, up to and including the last one."""
        while True:
            chunk = await self._ready.get()
            yield chunk
            if chunk.end:
                return


class Feeds:
    """The open inboxes of a stage replica."""

    def __init__(self) -> None:
        self._inboxes: dict[tuple[str, str], Inbox] = {}
        self._opened = asyncio.Event()  # set whenever an inbox opens

    def open(self, request_id: str, role: str) -> Inbox:
        key = (request_id, role)
        if key in self._inboxes:
            raise InvalidArgument(f"request {request_id} already streams into role {role!r} here")
        inbox = self._inboxes[key] = Inbox()
        self._opened.set()
        self._opened = asyncio.Event()
        return inbox

    def close(self, request_id: str, role: str) -> None:
        self._inboxes.pop((request_id, role), None)

    async def find(self, request_id: str, role: str, wait_s: float | None = None) -> Inbox:
        """The inbox of a running call, waiting up to `wait_s` (OPEN_WAIT_S) for it to open."""
        loop = asyncio.get_running_loop()
        until = loop.time() + (OPEN_WAIT_S if wait_s is None else wait_s)
        while (inbox := self._inboxes.get((request_id, role))) is None:
            left = until - loop.time()
            if left <= 0:
                raise NotFound(f"no streaming call of request {request_id} for role {role!r} runs here")
            opened = self._opened
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), left)
        return inbox

    def __len__(self) -> int:
        return len(self._inboxes)
