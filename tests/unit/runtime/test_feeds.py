"""Input streams of streaming stage calls (omni_common/runtime/feeds.py): chunks come out in
index order, each once, the last one ends the stream; a feed waits a little for its call to
open, then is NOT_FOUND; chunk indexes out of range are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_common.errors import InvalidArgument, NotFound
from omni_common.models.base import StageState
from omni_common.runtime.feeds import Chunk, Feeds, Inbox


def chunk(value: int, end: bool = False) -> Chunk:
    return Chunk(StageState({"x": torch.tensor([value])}), end)


async def drain(inbox: Inbox) -> list[int]:
    return [int(c.state.tensors["x"]) async for c in inbox.chunks()]


def test_chunks_come_in_order_each_once_until_the_end() -> None:
    inbox = Inbox()
    inbox.put(2, chunk(2))
    inbox.put(1, chunk(1))
    inbox.put(1, chunk(99))  # a repeat (a restarted producer): dropped
    inbox.put(4, chunk(4, end=True))
    inbox.put(3, chunk(3))
    inbox.put(5, chunk(5))  # after the end: dropped
    assert asyncio.run(drain(inbox)) == [1, 2, 3, 4]


def test_indexes_out_of_range_are_invalid() -> None:
    inbox = Inbox()
    inbox.put(0, chunk(0))  # chunk 0 came with the call: a repeat, dropped
    with pytest.raises(InvalidArgument, match="expects chunk 1"):
        inbox.put(10_000, chunk(1))
    inbox.put(1, chunk(1, end=True))
    assert asyncio.run(drain(inbox)) == [1]


def test_a_feed_waits_for_its_call_then_is_not_found() -> None:
    async def scenario() -> None:
        feeds = Feeds()
        waiting = asyncio.create_task(feeds.find("r1", "talker", wait_s=5))
        await asyncio.sleep(0.05)
        opened = feeds.open("r1", "talker")  # the Run call arrives after its first feed
        assert await waiting is opened
        with pytest.raises(NotFound, match="no streaming call"):
            await feeds.find("r2", "talker", wait_s=0.05)
        with pytest.raises(InvalidArgument, match="already streams"):
            feeds.open("r1", "talker")
        feeds.close("r1", "talker")
        assert len(feeds) == 0

    asyncio.run(scenario())
