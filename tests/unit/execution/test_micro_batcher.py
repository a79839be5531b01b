"""MicroBatcher: concurrent submissions share a batch; failures, cancels, deadlines and a
full queue each affect only their own request."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_common.errors import DeadlineExceeded, InvalidArgument, OmniError, ResourceExhausted
from omni_common.execution.batching import FOLLOWERS_WAIT_S, MicroBatcher


class Doubler:
    """A real batch function: doubles numbers, refuses negatives, records batch sizes."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.batches: list[list[int]] = []
        self.delay_s = delay_s

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await asyncio.sleep(self.delay_s)
        if any(i < 0 for i in items):
            if len(items) == 1:
                raise InvalidArgument(f"{items[0]} is negative")
            raise RuntimeError("a bad item in the batch")
        return [2 * i for i in items]


def test_concurrent_submissions_run_as_one_batch_with_a_window() -> None:
    async def main() -> tuple[list[int], Doubler]:
        fn = Doubler()
        batcher = MicroBatcher(fn, name="t", window_s=0.02, max_batch=8)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        batcher.close()
        return list(results), fn

    results, fn = asyncio.run(main())
    assert results == [0, 2, 4, 6, 8]
    assert fn.batches == [[0, 1, 2, 3, 4]]


def test_without_a_window_requests_arriving_during_a_batch_form_the_next() -> None:
    async def main() -> Doubler:
        fn = Doubler(delay_s=0.05)
        batcher = MicroBatcher(fn, name="t", max_batch=8)
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.01)
        await asyncio.gather(first, *(batcher.submit(i) for i in (2, 3, 4)))
        batcher.close()
        return fn

    assert asyncio.run(main()).batches == [[1], [2, 3, 4]]


def test_a_request_waits_for_its_announced_followers_within_a_bound() -> None:
    """A request whose followers left the previous stage with it (a DiT step that finished
    several) holds the batch for them; announced ones that never come cost FOLLOWERS_WAIT_S
    once, unannounced ones nothing."""

    async def main(followers: int, arrive: int) -> tuple[Doubler, float]:
        fn = Doubler()
        batcher = MicroBatcher(fn, name="t", max_batch=8)
        started = time.monotonic()
        first = asyncio.create_task(batcher.submit(1, followers=followers))
        await asyncio.sleep(FOLLOWERS_WAIT_S / 5)  # the followers, moments later
        await asyncio.gather(first, *(batcher.submit(i) for i in range(2, 2 + arrive)))
        batcher.close()
        return fn, time.monotonic() - started

    fn, _ = asyncio.run(main(followers=3, arrive=3))
    assert fn.batches == [[1, 2, 3, 4]]
    fn, _ = asyncio.run(main(followers=0, arrive=3))
    assert fn.batches == [[1], [2, 3, 4]]
    fn, took = asyncio.run(main(followers=5, arrive=0))
    assert fn.batches == [[1]] and took >= FOLLOWERS_WAIT_S


def test_max_batch_splits_batches() -> None:
    async def main() -> Doubler:
        fn = Doubler()
        batcher = MicroBatcher(fn, name="t", window_s=0.02, max_batch=2)
        await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        batcher.close()
        return fn

    assert [len(b) for b in asyncio.run(main()).batches] == [2, 2, 1]


def test_max_cost_splits_batches_but_never_leaves_an_item_out() -> None:
    async def main() -> Doubler:
        fn = Doubler()
        batcher = MicroBatcher(fn, name="t", window_s=0.02, max_batch=8, cost=lambda i: i, max_cost=5)
        await asyncio.gather(*(batcher.submit(i) for i in (1, 2, 3, 9, 1)))
        batcher.close()
        return fn

    # 1+2 fit, 3 would pass 5; 3 alone (9 would pass); 9 over the budget still runs, alone
    assert asyncio.run(main()).batches == [[1, 2], [3], [9], [1]]


def test_a_bad_item_fails_alone_with_its_own_error() -> None:
    async def main() -> list[object]:
        batcher = MicroBatcher(Doubler(), name="t", window_s=0.02)
        results = await asyncio.gather(*(batcher.submit(i) for i in (1, -1, 3)), return_exceptions=True)
        batcher.close()
        return list(results)

    good, bad, other = asyncio.run(main())
    assert (good, other) == (2, 6)
    assert isinstance(bad, InvalidArgument) and "negative" in bad.message


def test_full_queue_is_resource_exhausted_with_a_retry_hint() -> None:
    async def main() -> list[object]:
        batcher = MicroBatcher(Doubler(delay_s=0.05), name="enc", max_batch=1, max_queue=2)
        tasks = [asyncio.create_task(batcher.submit(0))]
        await asyncio.sleep(0.01)  # the first is running
        tasks += [asyncio.create_task(batcher.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0)  # two more queued
        results: list[object] = []
        try:
            await batcher.submit(9)
        except ResourceExhausted as err:
            results.append(err)
        results += await asyncio.gather(*tasks)
        batcher.close()
        return results

    err, *done = asyncio.run(main())
    assert isinstance(err, ResourceExhausted) and "enc is at capacity" in err.message
    assert err.retry_after_ms is not None and err.retry_after_ms >= 1
    assert done == [0, 2, 4]


def test_cancelled_and_expired_requests_never_reach_the_batch() -> None:
    async def main() -> tuple[Doubler, object]:
        fn = Doubler(delay_s=0.05)
        batcher = MicroBatcher(fn, name="t", max_batch=8)
        running = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.01)
        cancelled = asyncio.create_task(batcher.submit(2))
        expired = asyncio.create_task(batcher.submit(3, deadline=time.monotonic() + 0.001))
        kept = asyncio.create_task(batcher.submit(4))
        await asyncio.sleep(0)
        cancelled.cancel()
        outcome = await asyncio.gather(running, expired, kept, return_exceptions=True)
        batcher.close()
        return fn, outcome

    fn, (first, expired, kept) = asyncio.run(main())
    assert fn.batches == [[1], [4]]
    assert first == 2 and kept == 8
    assert isinstance(expired, DeadlineExceeded)


def test_an_internal_fault_is_internal_and_says_which_request() -> None:
    async def boom(items: list[int]) -> list[int]:
        raise RuntimeError("kaboom /secret/path")

    async def main() -> None:
        batcher = MicroBatcher(boom, name="vae-decode")
        with pytest.raises(OmniError) as caught:
            await batcher.submit(1, label="req-7")
        batcher.close()
        assert caught.value.code.name == "INTERNAL"
        assert "req-7" in caught.value.message and "/secret" not in caught.value.message

    asyncio.run(main())
