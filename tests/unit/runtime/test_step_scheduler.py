"""StepScheduler on the real tiny DiT: requests join and leave between steps, each keeps
its own result, and failures, deadlines, cancels and a full queue stay with their request.

Batched results are compared with tolerance 1e-5 (fp32): a batched forward runs different
matmul shapes than a lone one, so results differ by rounding (~1e-6 measured), never more.

The tests that pin ordering and failure run both loops: in order (CPU's default) and
overlapped (a GPU's: step k+1 launched before step k is reported; on the CPU the launch
computes, which changes nothing about the order of events).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_common.errors import DeadlineExceeded, OmniError, ResourceExhausted
from omni_common.models.base import GenerationRequest, StageState, StepRunner, StepState
from omni_common.models.qwen_omni.thinker import Thinker
from omni_common.models.qwen_omni.token2wav import Token2Wav
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.runtime.calls import FINISHED_WITH, Progress, StageCall
from omni_common.runtime.feeds import Chunk, Inbox
from omni_common.runtime.step_policy import FOLLOWERS_WAIT_S
from omni_common.runtime.step_scheduler import StepScheduler

CPU = torch.device("cpu")
TOL = 1e-5


@pytest.fixture(params=[False, True], ids=["in-order", "overlapped"])
def overlap(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture(scope="module")
def runners(tiny_model: Path) -> tuple[Any, StepRunner]:
    return (
        QwenImageEncoder.load(tiny_model, CPU, torch.float32),
        QwenImageDenoiser.load(tiny_model, CPU, torch.float32),
    )


def call(runners: tuple[Any, StepRunner], prompt: str, **fields: Any) -> StageCall:
    request = GenerationRequest(
        **{"prompt": prompt, "width": 64, "height": 64, "num_inference_steps": 4, **fields}
    )
    (inputs,) = runners[0].encode([request])
    return StageCall(request_id=prompt.replace(" ", "-")[:40], request=request, inputs=inputs)


def alone(denoiser: StepRunner, c: StageCall) -> torch.Tensor:
    state = denoiser.prepare(c.request, c.inputs)
    while not denoiser.is_done(state):
        denoiser.step([state])
    return denoiser.finish(state).tensors["latents"]


Compute = Callable[..., Awaitable[Any]]


def run_async(main: Callable[[Compute], Awaitable[Any]]) -> Any:
    """Run `main(compute)` with a one-thread compute executor, like a worker's."""
    executor = ThreadPoolExecutor(max_workers=1)

    async def compute(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    try:
        return asyncio.run(main(compute))
    finally:
        executor.shutdown()


async def result_of(
    events: AsyncIterator[Any], on_step: Callable[[int], None] = lambda _: None
) -> StageState:
    async for event in events:
        if isinstance(event, StageState):
            return event
        on_step(event.step)
    raise AssertionError("no result")


def test_requests_joining_between_steps_match_their_solo_results(runners, overlap) -> None:
    first = call(runners, "a red house", num_inference_steps=6, seed=1)
    late = call(runners, "a much longer prompt about a small blue boat at sea", num_inference_steps=3, seed=2)

    async def main(compute: Compute) -> tuple[StageState, StageState, list[int]]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        joined = asyncio.Event()
        steps_of_first: list[int] = []

        def maybe_join(step: int) -> None:
            steps_of_first.append(step)
            if step == 2:
                joined.set()

        a = asyncio.create_task(result_of(scheduler.run(first), maybe_join))
        await joined.wait()
        b = await result_of(scheduler.run(late))
        result = (await a, b, list(scheduler.batch_sizes))
        scheduler.close()
        return result

    a, b, sizes = run_async(main)
    assert 2 in sizes, f"the late request never shared a forward: {sizes}"
    for c, got in ((first, a), (late, b)):
        torch.testing.assert_close(got.tensors["latents"], alone(runners[1], c), atol=TOL, rtol=0)


def test_requests_admitted_together_start_in_one_forward(runners, overlap) -> None:
    """Four requests arriving at once: the first waits for the others being admitted, so the
    four share every forward (3 forwards for 3 steps, not a first one alone and a 4th). The
    wait's bound is raised far above the admissions' time, so a loaded machine cannot end it
    first: it ends when the last of the four is admitted, not at the bound."""
    calls = [call(runners, f"together {i}", seed=i, num_inference_steps=3) for i in range(4)]

    async def main(compute: Compute) -> tuple[list[StageState], list[int]]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap, admit_wait_s=60.0)
        results = await asyncio.gather(*(result_of(scheduler.run(c)) for c in calls))
        scheduler.close()
        return list(results), list(scheduler.batch_sizes)

    results, sizes = run_async(main)
    assert sizes == [4, 4, 4]
    for c, got in zip(calls, results, strict=True):
        torch.testing.assert_close(got.tensors["latents"], alone(runners[1], c), atol=TOL, rtol=0)


def test_a_batch_window_gathers_requests_that_arrive_apart(runners, overlap) -> None:
    """With a batch window, a request that arrives 100 ms after another (its state long
    prepared) still shares the other's first forward; without one the first starts alone,
    before the second arrives (which comes once the first's first step is reported: no
    ordering by time)."""
    calls = [call(runners, f"apart {i}", seed=i, num_inference_steps=3) for i in range(2)]

    async def window(compute: Compute) -> list[int]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap, batch_window_s=0.5)
        first = asyncio.create_task(result_of(scheduler.run(calls[0])))
        await asyncio.sleep(0.1)
        await result_of(scheduler.run(calls[1]))
        await first
        scheduler.close()
        return list(scheduler.batch_sizes)

    async def no_window(compute: Compute) -> list[int]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        events = scheduler.run(calls[0])
        assert isinstance(await anext(events), Progress)  # its first step ran
        await result_of(scheduler.run(calls[1]))
        await result_of(events)
        scheduler.close()
        return list(scheduler.batch_sizes)

    assert run_async(window) == [2, 2, 2]
    assert run_async(no_window)[0] == 1


def test_a_request_waits_for_the_followers_its_call_announces(runners, overlap) -> None:
    """A call that says 2 more like it are coming (the coordinator saw them in the encoder)
    holds its first step for them, within FOLLOWERS_WAIT_S: the 3 share every forward. One
    whose announced followers never come starts alone once the wait is over."""
    calls = [call(runners, f"burst {i}", seed=i, num_inference_steps=3) for i in range(3)]

    async def main(compute: Compute, followers: int, arrive: int) -> tuple[list[int], float]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        first = replace(calls[0], followers=followers)
        started = time.monotonic()
        tasks = [asyncio.create_task(result_of(scheduler.run(first)))]
        await asyncio.sleep(FOLLOWERS_WAIT_S / 4)  # the next wave, later than the admission wait
        tasks += [asyncio.create_task(result_of(scheduler.run(c))) for c in calls[1 : 1 + arrive]]
        await asyncio.gather(*tasks)
        scheduler.close()
        return list(scheduler.batch_sizes), time.monotonic() - started

    sizes, _ = run_async(lambda compute: main(compute, 2, 2))
    assert sizes == [3, 3, 3]
    sizes, _ = run_async(lambda compute: main(compute, 0, 2))
    assert sizes[0] == 1  # nothing announced: no wait
    sizes, took = run_async(lambda compute: main(compute, 5, 0))
    assert sizes == [1, 1, 1] and took >= FOLLOWERS_WAIT_S


def test_requests_one_step_finished_say_how_many_finished_with_them(runners, overlap) -> None:
    """Results carry FINISHED_WITH when their step finished others too: the coordinator tells
    the next stage to wait for them (batching.FOLLOWERS_WAIT_S); a lone result does not."""
    pair = [call(runners, f"pair {i}", seed=i, num_inference_steps=2) for i in range(2)]
    lone = call(runners, "lone", seed=5, num_inference_steps=2)

    async def main(compute: Compute) -> tuple[list[StageState], StageState, list[int]]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        together = await asyncio.gather(*(result_of(scheduler.run(c)) for c in pair))
        alone = await result_of(scheduler.run(lone))
        scheduler.close()
        return list(together), alone, list(scheduler.batch_sizes)

    together, alone, sizes = run_async(main)
    assert sizes == [2, 2, 1, 1]
    assert [result.meta.get(FINISHED_WITH) for result in together] == ["1", "1"]
    assert FINISHED_WITH not in alone.meta


class IdleCounting(QwenImageDenoiser):
    """The tiny denoiser with `units` of idle work (a GPU denoiser's graphs captured ahead)."""

    units = 0
    done_while_busy = 0
    scheduler: StepScheduler | None = None

    def idle_work(self) -> bool:
        if self.units == 0:
            return False
        if self.scheduler is not None and self.scheduler.jobs:
            self.done_while_busy += 1
        self.units -= 1
        time.sleep(0.01)
        return True

    def idle_work_left(self) -> int:
        return self.units


def test_idle_work_runs_between_requests_and_never_beside_one(runners, tiny_model: Path) -> None:
    runner = IdleCounting.load(tiny_model, CPU, torch.float32)
    c = call(runners, "a quiet stage", seed=3, num_inference_steps=3)

    async def main(compute: Compute) -> StageState:
        scheduler = runner.scheduler = StepScheduler(runner, compute)
        runner.units = 5
        first = await result_of(scheduler.run(c))  # the loop starts with the first request
        for _ in range(100):
            if runner.units == 0:
                break
            await asyncio.sleep(0.01)
        assert runner.units == 0  # done while no request was here
        runner.units = 1000
        second = await result_of(scheduler.run(c))
        await asyncio.sleep(0.05)
        assert runner.units < 1000  # idle again after the request: back to work
        scheduler.close()
        # The metric follows the runner's count (one unit may still be running as it is read).
        assert scheduler.totals.idle_work_left - runner.units in (0, 1)
        torch.testing.assert_close(second.tensors["latents"], first.tensors["latents"], atol=TOL, rtol=0)
        return first

    run_async(main)
    assert runner.done_while_busy == 0


def test_idle_work_the_runner_has_from_the_start_begins_before_any_request(tiny_model: Path) -> None:
    """A warm start's deferred warm-up loads while the stage waits for its first request."""
    runner = IdleCounting.load(tiny_model, CPU, torch.float32)
    runner.units = 3

    async def main(compute: Compute) -> int:
        scheduler = StepScheduler(runner, compute)
        assert scheduler.totals.idle_work_left == 3
        for _ in range(300):  # the metric is counted once each unit has returned
            if scheduler.totals.idle_work_left == 0:
                break
            await asyncio.sleep(0.01)
        scheduler.close()
        return scheduler.totals.idle_work_left

    assert run_async(main) == 0 and runner.units == 0


class IdleFailing(IdleCounting):
    """Idle work that fails (a CUDA graph that cannot be recorded) with units still counted."""

    def idle_work(self) -> bool:
        raise RuntimeError("cannot record this graph")


def test_failed_idle_work_stops_and_counts_none_left_and_requests_still_run(
    runners, tiny_model: Path
) -> None:
    """The scheduler stops a runner's idle work at its first failure; the metric then says none
    is left (a benchmark waiting for it goes on) and requests are served as before."""
    runner = IdleFailing.load(tiny_model, CPU, torch.float32)
    runner.units = 3
    c = call(runners, "after a failed recording", seed=3, num_inference_steps=2)

    async def main(compute: Compute) -> tuple[StageState, int]:
        scheduler = StepScheduler(runner, compute)
        assert scheduler.totals.idle_work_left == 3
        for _ in range(300):  # the loop starts on the idle work, which fails at once
            if scheduler.totals.idle_work_left == 0:
                break
            await asyncio.sleep(0.01)
        left = scheduler.totals.idle_work_left
        result = await result_of(scheduler.run(c))
        scheduler.close()
        return result, left

    result, left = run_async(main)
    assert left == 0 and runner.units == 3
    torch.testing.assert_close(result.tensors["latents"], alone(runners[1], c), atol=TOL, rtol=0)


def test_cfg_and_plain_requests_in_one_stream_each_batch_with_their_own_kind(runners, overlap) -> None:
    calls = [
        call(runners, "cfg one", negative_prompt="blurry", true_cfg_scale=4.0, seed=3),
        call(runners, "plain one", seed=4),
        call(runners, "cfg two", negative_prompt="dark and grainy", true_cfg_scale=4.0, seed=5),
        call(runners, "plain two", seed=6, num_inference_steps=2),
    ]

    async def main(compute: Compute) -> tuple[list[StageState], list[int]]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        results = await asyncio.gather(*(result_of(scheduler.run(c)) for c in calls))
        scheduler.close()
        return list(results), list(scheduler.batch_sizes)

    results, sizes = run_async(main)
    assert max(sizes) == 2 and sum(sizes) == 4 + 4 + 4 + 2
    for c, got in zip(calls, results, strict=True):
        torch.testing.assert_close(got.tensors["latents"], alone(runners[1], c), atol=TOL, rtol=0)


def test_oldest_first_a_later_stream_never_starves_an_earlier_request(runners) -> None:
    """`other` (another size) arrives with `big`; a stream of requests with big's batch key keeps
    coming while big steps. Once big is done, `other` is the oldest and runs before them all.

    The stream is driven by big's own step events, not by timers: each later request is sent
    after big has stepped at least once, so none can share big's first forward and finish with
    it, however fast or loaded the machine is."""
    big = call(runners, "64 square", seed=1)
    other = StageCall(
        request_id="other-size",
        request=GenerationRequest(prompt="32 square", width=32, height=32, num_inference_steps=4),
        inputs=big.inputs,
    )
    # big's step after which each later request is sent: while big still has steps to run.
    send_after = {1: ["later-0"], 2: ["later-1"], 3: ["later-2", "later-3"]}

    async def main(compute: Compute) -> list[str]:
        scheduler = StepScheduler(runners[1], compute)
        finished: list[str] = []
        tasks: list[asyncio.Task[None]] = []

        async def run(c: StageCall, on_step: Callable[[int], None] = lambda _: None) -> None:
            await result_of(scheduler.run(c), on_step)
            finished.append(c.request_id)

        def send_later(step: int) -> None:
            for request_id in send_after.get(step, []):
                later = StageCall(request_id=request_id, request=big.request, inputs=big.inputs)
                tasks.append(asyncio.create_task(run(later)))

        first = [asyncio.create_task(run(big, send_later)), asyncio.create_task(run(other))]
        await asyncio.gather(*first)
        await asyncio.gather(*tasks)
        scheduler.close()
        return finished

    finished = run_async(main)
    assert finished[0] == big.request_id and len(finished) == 6
    assert finished.index("other-size") < min(finished.index(f"later-{i}") for i in range(4))


class Poisoned:
    """The real runner, except that steps fail for prompts saying "raise" and turn the
    latents of prompts saying "nan" into NaN."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def step(self, states: list[StepState]) -> None:
        if any("raise" in s.request.prompt for s in states):
            raise RuntimeError("injected fault")
        self.runner.step(states)
        for s in states:
            if "nan" in s.request.prompt:
                s.latents.fill_(float("nan"))  # type: ignore[attr-defined]


@pytest.mark.parametrize("poison", ["please raise", "a nan prompt"])
def test_a_poisoned_request_fails_alone_and_its_batch_mates_finish_correctly(
    runners, overlap, poison
) -> None:
    good = [call(runners, "good one", seed=1), call(runners, "good two", seed=2)]
    bad = call(runners, poison, seed=3)

    async def main(compute: Compute) -> list[Any]:
        scheduler = StepScheduler(Poisoned(runners[1]), compute, overlap=overlap)  # type: ignore[arg-type]
        results = await asyncio.gather(
            *(result_of(scheduler.run(c)) for c in (good[0], bad, good[1])), return_exceptions=True
        )
        scheduler.close()
        return list(results)

    first, failed, second = run_async(main)
    assert isinstance(failed, OmniError) and failed.code.name == "INTERNAL"
    assert bad.request_id in failed.message
    for c, got in zip(good, (first, second), strict=True):
        torch.testing.assert_close(got.tensors["latents"], alone(runners[1], c), atol=TOL, rtol=0)


def test_expired_deadline_is_dropped_before_more_compute(runners) -> None:
    c = call(runners, "late", num_inference_steps=200)
    c = StageCall(c.request_id, c.request, c.inputs, deadline=time.monotonic() + 0.15)

    async def main(compute: Compute) -> tuple[BaseException | None, list[int]]:
        scheduler = StepScheduler(runners[1], compute)
        steps: list[int] = []
        try:
            await result_of(scheduler.run(c), steps.append)
        except DeadlineExceeded as err:
            scheduler.close()
            return err, steps
        return None, steps

    err, steps = run_async(main)
    assert err is not None and "deadline passed at step" in str(err)
    assert 0 < len(steps) < 200


def test_a_full_queue_is_resource_exhausted_with_a_retry_hint(runners) -> None:
    c = call(runners, "one", num_inference_steps=20)

    async def main(compute: Compute) -> ResourceExhausted:
        scheduler = StepScheduler(runners[1], compute, max_queue=1)
        running = asyncio.create_task(result_of(scheduler.run(c)))
        while not scheduler.jobs:
            await asyncio.sleep(0.001)
        with pytest.raises(ResourceExhausted) as caught:
            await result_of(scheduler.run(c))
        await running
        scheduler.close()
        return caught.value

    err = run_async(main)
    assert "dit-denoise is at capacity" in err.message and err.retry_after_ms is not None


def test_a_request_being_prepared_counts_toward_a_full_queue(runners) -> None:
    """A burst arrives faster than its requests are prepared: the bound holds all the same."""
    c = call(runners, "prepared slowly", num_inference_steps=4)
    preparing, release = threading.Event(), threading.Event()

    class SlowPrepare:
        def __getattr__(self, name: str) -> Any:
            return getattr(runners[1], name)

        def prepare(self, request: GenerationRequest, inputs: StageState) -> Any:
            preparing.set()
            release.wait(30)
            return runners[1].prepare(request, inputs)

    async def main(compute: Compute) -> ResourceExhausted:
        scheduler = StepScheduler(SlowPrepare(), compute, max_queue=1)
        first = asyncio.create_task(result_of(scheduler.run(c)))
        while not preparing.is_set():
            await asyncio.sleep(0.001)
        assert not scheduler.jobs  # still being prepared
        with pytest.raises(ResourceExhausted) as caught:
            await result_of(scheduler.run(c))
        release.set()
        await first
        scheduler.close()
        return caught.value

    err = run_async(main)
    assert "at capacity (1 requests)" in err.message


def test_a_request_whose_caller_leaves_is_dropped_at_the_next_step(runners, overlap) -> None:
    c = call(runners, "leaving", num_inference_steps=500)

    async def main(compute: Compute) -> tuple[int, int]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        events = scheduler.run(c)
        async for event in events:
            if event.step == 3:
                break
        await events.aclose()
        await asyncio.sleep(0.2)
        left = len(scheduler.jobs)
        scheduler.close()
        return left, sum(scheduler.batch_sizes)

    left, steps = run_async(main)
    assert left == 0 and steps < 10


def test_overlapped_steps_report_in_order_with_checkpoints_of_the_step_they_name(runners) -> None:
    c = call(runners, "checkpointed", num_inference_steps=6, seed=7)
    c = StageCall(c.request_id, c.request, c.inputs, checkpoint_every=2)
    other = call(runners, "keeps the device busy", num_inference_steps=6, seed=8)

    async def main(compute: Compute) -> tuple[list[Any], int]:
        scheduler = StepScheduler(runners[1], compute, overlap=True)
        events: list[Any] = []

        async def collect() -> None:
            async for event in scheduler.run(c):
                events.append(event)

        await asyncio.gather(collect(), result_of(scheduler.run(other)))
        scheduler.close()
        return events, scheduler.totals.steps

    events, steps = run_async(main)
    progress, result = events[:-1], events[-1]
    assert [p.step for p in progress] == list(range(1, 7)) and 6 <= steps <= 12
    denoiser = runners[1]
    state = denoiser.prepare(c.request, c.inputs)
    for p in progress:
        denoiser.step([state])
        if p.checkpoint is not None:
            assert p.step in (2, 4) and p.checkpoint.meta["step_index"] == str(p.step)
            torch.testing.assert_close(p.checkpoint.tensors["latents"], state.latents, atol=TOL, rtol=0)
    assert sum(p.checkpoint is not None for p in progress) == 2
    torch.testing.assert_close(result.tensors["latents"], state.latents, atol=TOL, rtol=0)


def test_previews_show_the_step_they_are_reported_with(runners, overlap) -> None:
    from omni_common.imaging import to_png

    c = call(runners, "previewed", num_inference_steps=5, seed=9)
    c = StageCall(c.request_id, c.request, c.inputs, preview_every=2)

    async def main(compute: Compute) -> list[Any]:
        scheduler = StepScheduler(runners[1], compute, overlap=overlap)
        events = [event async for event in scheduler.run(c)]
        scheduler.close()
        return events

    progress = [e for e in run_async(main)[:-1] if e.preview_png]
    assert [p.step for p in progress] == [2, 4, 5]  # every 2nd step and the last
    denoiser = runners[1]
    state = denoiser.prepare(c.request, c.inputs)
    for p in progress:
        while state.step_index < p.step:
            denoiser.step([state])
        assert p.preview_png == to_png(denoiser.preview(state))


def test_a_finished_request_s_log_line_gives_its_prepare_and_first_chunk_times(
    omni_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stage's line for a finished request times its call: prepared (the prefill) and its
    first chunk reported, in ms after the call reached the stage (a streaming runner, the tiny
    thinker: its chunks are text deltas and talker rows)."""
    thinker = Thinker.load(omni_model, CPU, torch.float32)
    options = (("max_new_tokens", "12"), ("audio", "1"))
    request = StageCall(
        request_id="timed", request=GenerationRequest(prompt="hello", options=options), inputs=StageState({})
    )

    async def main(compute: Compute) -> list[int]:
        scheduler = StepScheduler(thinker, compute)
        chunks_at = []
        async for event in scheduler.run(request):
            if isinstance(event, Progress) and event.partial is not None:
                chunks_at.append(event.step)
        scheduler.close()
        return chunks_at

    with caplog.at_level(logging.INFO, "omnistage.steps"):
        chunks_at = run_async(main)
    assert chunks_at, "the thinker streamed no chunk"
    line = next(r.getMessage() for r in caplog.records if "request timed:" in r.getMessage())
    found = re.search(r"; prepared (\d+) ms after its call, first chunk at (\d+) ms$", line)
    assert found, line
    assert int(found[2]) >= int(found[1])


@pytest.mark.parametrize("end_apart", [False, True], ids=["end-with-codes", "end-alone"])
def test_token2wav_windows_that_close_together_hand_over_every_chunk(
    omni_model: Path, end_apart: bool
) -> None:
    """A short reply (16 codes: 12, then 4 and the end) opens its two windows in one step, so
    they close in one step; the stage hands over one chunk a step: the second must still go out
    and the call finish (it waited forever, the state never ready again). The chunks are the
    ones a loop that takes every chunk each step makes."""
    token2wav = Token2Wav.load(omni_model, CPU)
    request = GenerationRequest(prompt="", seed=0, num_inference_steps=10)
    first, rest = StageState({"codes": torch.arange(12)}), StageState({"codes": torch.arange(12, 16)})
    inbox = Inbox()  # the talker's later chunks and its end, there before the call starts
    inbox.put(1, Chunk(rest, end=not end_apart))
    if end_apart:
        inbox.put(2, Chunk(StageState({}), end=True))
    call = StageCall(request_id="short", request=request, inputs=first, inbox=inbox)

    async def main(compute: Compute) -> list[torch.Tensor]:
        scheduler = StepScheduler(token2wav, compute)
        chunks = []
        async for event in scheduler.run(call):
            if isinstance(event, Progress) and event.partial is not None:
                chunks.append(event.partial.tensors["mel"])
        scheduler.close()
        return chunks

    chunks = run_async(main)
    state = token2wav.prepare(request, first)
    token2wav.feed(state, rest, end=True)
    expected = []
    while not token2wav.is_done(state):
        token2wav.step([state])
        while (partial := token2wav.take_partial(state)) is not None:
            expected.append(partial.tensors["mel"])
    assert len(expected) == 2, "the two windows did not close in one step: the test lost its point"
    assert len(chunks) == 2
    for got, want in zip(chunks, expected, strict=True):
        assert torch.equal(got, want)
