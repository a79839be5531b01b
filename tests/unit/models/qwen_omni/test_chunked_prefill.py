"""Chunked prefill in the thinker (tiny fixture, CPU fp32): a prompt within one chunk is
prefilled at admission exactly as before when it is alone, and by the next step beside others
(a burst holds a running reply up one prompt a step, each reply its lone tokens); a longer one
runs a chunk per step and picks the whole prefill's greedy tokens, with its talker rows, KV and
first logits within float rounding (chunks change the shapes of the attention and matrix
products, not the computation); a chunk that would split an audio clip or a video runs to its
end; a running reply steps exactly once between two chunks of a prompt that joins it; a request
cancelled mid-prefill frees its slot."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from omni_common.audio_input import inspect_audio, wav_bytes
from omni_common.input_media import input_audio_name, input_video_name
from omni_common.models.base import ChatTurn, GenerationRequest, StageState, StepState
from omni_common.models.qwen_omni.thinker import Thinker, ThinkerState
from omni_common.runtime.calls import StageCall
from omni_common.runtime.metrics import StageMetrics
from omni_common.runtime.step_scheduler import StepScheduler, StepTotals
from omni_common.video_input import inspect_video
from tests.unit.models.qwen_omni.test_prefix import video

CPU = torch.device("cpu")
CHUNK = 16
SHORT = "Tell me a short story."
BURST = ("Say hi.", "Name a colour.", "Count to three.")  # prompts that join at once
LONG = " ".join(f"Sentence {i} of a long prompt about boats, rivers and the sea." for i in range(8))
# Chunked against whole prefill, fp32, 351 tokens in 22 chunks: measured max |difference|
# 3.6e-7 in the talker rows, 7.5e-8 in the keys, 3.0e-8 in the values and in the first token's
# logits (printed by the test).
TOL = 1e-5
Compute = Callable[..., Awaitable[Any]]
Medium = tuple[str, bytes] | None  # ("audio", a WAV file) or ("video", a serialized InputVideo)


class StepLog(Thinker):
    """The thinker with its steps logged: after each step, (state, step_index, prefilling?) of
    every state in it. A test may hold the compute thread after a chunk step (`chunk_done` is
    called, then the step waits for `proceed`) and hear of releases (`released`)."""

    log: list[list[tuple[ThinkerState, int, bool]]]
    prefilled: list[ThinkerState | None]  # after each step, the state it prefilled a chunk of
    chunk_done: Callable[[], None] | None = None
    proceed: threading.Event | None = None
    released: Callable[[], None] | None = None

    def release(self, state: StepState) -> None:
        super().release(state)
        if self.released is not None:
            self.released()

    def step(self, states: Sequence[StepState]) -> None:
        prefilled = self.next_prefill(states)
        chunked = prefilled is not None
        super().step(states)
        self.log.append(
            [(s, s.step_index, s.prefill is not None) for s in states if isinstance(s, ThinkerState)]
        )
        self.prefilled.append(prefilled if isinstance(prefilled, ThinkerState) else None)
        if chunked and self.chunk_done is not None and self.proceed is not None:
            self.chunk_done()
            assert self.proceed.wait(timeout=120), "the test never let the step go on"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def whole(omni_model: Path) -> Thinker:
    return Thinker.load(omni_model, CPU, torch.float32, max_slots=2, prefix_bytes=0)


@pytest.fixture(scope="module")
def chunked(omni_model: Path) -> StepLog:
    thinker = StepLog.load(
        omni_model, CPU, torch.float32, max_slots=4, prefix_bytes=0, prefill_chunk_tokens=CHUNK
    )
    assert isinstance(thinker, StepLog)
    thinker.log, thinker.prefilled = [], []
    return thinker


@pytest.fixture(scope="module")
def roomy(omni_model: Path) -> StepLog:
    """Chunks of 512 tokens: every prompt of these tests fits one."""
    thinker = StepLog.load(
        omni_model, CPU, torch.float32, max_slots=4, prefix_bytes=0, prefill_chunk_tokens=512
    )
    assert isinstance(thinker, StepLog)
    thinker.log, thinker.prefilled = [], []
    return thinker


def request(prompt: str = LONG, tokens: int = 6, medium: Medium = None) -> GenerationRequest:
    """A greedy spoken reply to `prompt`, after `medium` (an audio clip or a video) if given."""
    options = (("audio", "1"), ("max_new_tokens", str(tokens)), ("thinker_do_sample", "0"))
    if medium is None:
        return GenerationRequest(prompt=prompt, seed=1, options=options)
    kind, data = medium
    turn = ChatTurn("user", ((kind, 0), ("text", prompt)))
    if kind == "audio":
        return GenerationRequest(
            prompt="", messages=(turn,), audios=(inspect_audio(data, index=0),), options=options
        )
    videos = (inspect_video(data, index=0, max_pixels=1 << 22),)
    return GenerationRequest(prompt="", messages=(turn,), videos=videos, options=options)


def inputs(medium: Medium) -> StageState:
    if medium is None:
        return StageState({})
    kind, data = medium
    name = input_audio_name(0) if kind == "audio" else input_video_name(0)
    return StageState({name: torch.frombuffer(bytearray(data), dtype=torch.uint8)})


class Run:
    """What a thinker made of one request stepped alone: its tokens, talker rows of the prompt,
    KV right after the prefill, the first token's logits and the chunk steps it took."""

    def __init__(self, thinker: Thinker, gen: GenerationRequest, medium: Medium = None) -> None:
        logits: list[torch.Tensor] = []
        hook = thinker.model.lm_head.register_forward_hook(
            lambda _m, _i, out: logits.append(out.reshape(-1, out.shape[-1])[-1:].detach())
        )
        try:
            state = thinker.prepare(gen, inputs(medium))
            self.chunk_steps = 0
            while state.prefill is not None:
                thinker.step([state])
                self.chunk_steps += 1
            self.first_logits = logits[-1]
        finally:
            hook.remove()
        self.keys, self.values = thinker.slots.read(state.slot)
        self.rows = state.first["prompt"]
        while not thinker.is_done(state):
            thinker.step([state])
        self.tokens = state.generated.tolist()
        thinker.finish(state)


def sibling(thinker: Thinker, chunk_tokens: int) -> Thinker:
    """A one-slot thinker over `thinker`'s model, prefilling in chunks of `chunk_tokens`."""
    return Thinker(
        thinker.model,
        thinker.processor,
        thinker.speakers,
        thinker.talker_text_ids,
        CPU,
        torch.float32,
        max_slots=1,
        prefix_bytes=0,
        prefill_chunk_tokens=chunk_tokens,
    )


def largest(a: Sequence[torch.Tensor] | torch.Tensor, b: Sequence[torch.Tensor] | torch.Tensor) -> float:
    pairs = zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]
    return max(float((x - y).abs().max()) for x, y in pairs)


def test_a_prompt_within_one_chunk_is_prefilled_at_admission_bitwise_as_before(
    whole: Thinker, chunked: StepLog
) -> None:
    big = sibling(chunked, 512)
    before, after = Run(whole, request(SHORT)), Run(big, request(SHORT))
    assert after.chunk_steps == 0
    assert after.tokens == before.tokens
    assert torch.equal(after.rows, before.rows) and torch.equal(after.first_logits, before.first_logits)
    assert all(torch.equal(x, y) for x, y in zip(after.keys, before.keys, strict=True))


def test_a_long_prompt_in_chunks_picks_the_whole_prefills_tokens(whole: Thinker, chunked: StepLog) -> None:
    before = Run(whole, request())
    counted = chunked.prefill_chunks()
    after = Run(chunked, request())
    length = before.rows.shape[0]
    assert length > 3 * CHUNK, f"the prompt has {length} tokens: too few for several chunks"
    assert (
        after.chunk_steps == -(-length // CHUNK) and chunked.prefill_chunks() == counted + after.chunk_steps
    )
    assert after.tokens == before.tokens
    differences = {
        "rows": largest(after.rows, before.rows),
        "keys": largest(after.keys, before.keys),
        "values": largest(after.values, before.values),
        "logits": largest(after.first_logits, before.first_logits),
    }
    print(f"chunked vs whole prefill ({length} tokens, {after.chunk_steps} chunks): {differences}")
    assert max(differences.values()) < TOL
    assert not chunked.slots.active


def test_prompts_joining_together_are_prefilled_one_chunk_a_step_first_come_first(chunked: StepLog) -> None:
    first, second = (chunked.prepare(request(), StageState({})) for _ in range(2))
    counted, steps = chunked.prefill_chunks(), 0
    progress = []
    while first.prefill is not None or second.prefill is not None:
        chunked.step([second, first])
        steps += 1
        progress.append((first.prefill is None, second.prefill.done if second.prefill is not None else -1))
    assert chunked.prefill_chunks() - counted == steps  # one chunk a step
    done_at = next(i for i, (finished, _) in enumerate(progress) if finished)
    assert all(done == 0 for _, done in progress[: done_at + 1]), "the second waited for the first"
    chunked.release(first)
    chunked.release(second)
    assert not chunked.slots.active


def test_under_the_graphed_decode_a_chunk_after_cached_tokens_attends_causally(
    omni_model: Path, whole: Thinker
) -> None:
    """The graphed decode's prefills take no mask from transformers; after cached tokens the
    causal mask must be offset by them (SDPA's causal flag aligns it top-left: before the fix
    a reused prefix's remainder picked its first token from logits 0.02 off, on this fixture)."""
    graphed = Thinker.load(
        omni_model,
        CPU,
        torch.float32,
        max_slots=1,
        decode="graphs",
        prefix_bytes=0,
        prefill_chunk_tokens=CHUNK,
    )
    before, after = Run(whole, request()), Run(graphed, request())
    assert after.chunk_steps > 1 and after.tokens == before.tokens
    assert largest(after.first_logits, before.first_logits) < TOL and largest(after.rows, before.rows) < TOL


@pytest.mark.parametrize("kind", ["audio", "video"])
def test_a_chunk_that_would_split_a_clip_or_video_runs_to_its_end(
    omni_model: Path, whole: Thinker, chunked: StepLog, kind: str
) -> None:
    noise = np.random.default_rng(5).uniform(-0.5, 0.5, 8000).astype(np.float32)
    medium = (kind, wav_bytes(noise, 16_000) if kind == "audio" else video(5))
    gen = request(SHORT, medium=medium)
    state = whole.prepare(gen, inputs(medium))
    ((opens, closes),) = state.prompt.spans
    whole.finish(state)
    # A chunk size that ends the first chunk just past the clip's opening marker.
    split = sibling(chunked, opens + 1)
    assert state.prompt.chunk_end(0, opens + 1) == closes + 1
    before, after = Run(whole, gen, medium), Run(split, gen, medium)
    assert after.chunk_steps >= 2
    assert after.tokens == before.tokens
    assert largest(after.rows, before.rows) < TOL and largest(after.first_logits, before.first_logits) < TOL


def run_async(main: Callable[[Compute], Awaitable[Any]]) -> Any:
    """Run `main(compute)` with a one-thread compute executor, like a worker's."""
    executor = ThreadPoolExecutor(max_workers=1)

    async def compute(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    try:
        return asyncio.run(main(compute))
    finally:
        executor.shutdown()


def stage_call(name: str, gen: GenerationRequest) -> StageCall:
    return StageCall(request_id=name, request=gen, inputs=StageState({}))


async def result_of(
    events: AsyncIterator[Any], on_step: Callable[[int], None] = lambda _: None
) -> StageState:
    async for event in events:
        if isinstance(event, StageState):
            return event
        on_step(event.step)
    raise AssertionError("no result")


def join_a_running_reply(thinker: StepLog, joining: Sequence[GenerationRequest]) -> None:
    """Through the stage's scheduler: a reply of 40 tokens runs, and once it has stepped twice
    the `joining` requests arrive at once; every request runs to its end (the steps logged)."""

    async def main(compute: Compute) -> None:
        scheduler = StepScheduler(thinker, compute, name="ar-encoder")
        decoding = asyncio.Event()
        running = asyncio.create_task(
            result_of(
                scheduler.run(stage_call("running", request(SHORT, tokens=40))),
                lambda s: s == 2 and decoding.set(),
            )
        )
        await decoding.wait()
        calls = (scheduler.run(stage_call(f"joining {i}", gen)) for i, gen in enumerate(joining))
        await asyncio.gather(*(result_of(events) for events in calls))
        await running
        scheduler.close()

    thinker.log, thinker.prefilled = [], []
    run_async(main)


def test_a_running_reply_steps_once_between_two_chunks_of_a_joining_prompt(chunked: StepLog) -> None:
    join_a_running_reply(chunked, [request()])
    joining = [step for step in chunked.log if any(p and s.request.prompt == LONG for s, _, p in step)]
    running_steps = [index for step in joining for state, index, _ in step if state.request.prompt == SHORT]
    assert len(joining) >= 3, "the joining prompt took several chunks"
    # The running reply was in every chunk's step, and advanced by exactly one token each time.
    assert len(running_steps) == len(joining)
    assert running_steps == list(range(running_steps[0], running_steps[0] + len(joining)))
    assert not chunked.slots.active


def test_a_request_cancelled_mid_prefill_frees_its_slot(chunked: StepLog) -> None:
    async def main(compute: Compute) -> None:
        loop = asyncio.get_running_loop()
        scheduler = StepScheduler(chunked, compute, name="ar-encoder")
        first_chunk, released = asyncio.Event(), asyncio.Event()
        chunked.chunk_done = lambda: loop.call_soon_threadsafe(first_chunk.set)
        chunked.released = lambda: loop.call_soon_threadsafe(released.set)
        chunked.proceed = threading.Event()
        task = asyncio.create_task(result_of(scheduler.run(stage_call("cancelled", request()))))
        await first_chunk.wait()  # the compute thread holds after the first chunk
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        chunked.chunk_done = None
        chunked.proceed.set()
        await released.wait()  # the next round drops the gone request and releases its slot
        scheduler.close()

    chunked.log = []
    try:
        run_async(main)
    finally:
        chunked.chunk_done, chunked.proceed, chunked.released = None, None, None
    ((state, index, prefilling),) = chunked.log[0]
    assert len(chunked.log) == 1 and prefilling and index == 0, "it left after one chunk, mid-prefill"
    assert state.slot.released and state.prefill is None and not chunked.slots.active


def test_the_stage_metrics_count_prefill_chunks() -> None:
    metrics = StageMetrics(
        "ar-encoder", lambda: 0, lambda: 0, lambda: {"thinker": StepTotals(prefill_chunks=3)}
    )
    text = generate_latest(metrics.registry).decode()
    assert 'omnistage_prefill_chunks_total{role="thinker",stage="ar-encoder"} 3.0' in text


def joined_run(thinker: Thinker) -> list[list[int]]:
    """A short reply from step 0 and the long prompt joining at step 2, stepped together as a
    scheduler steps them (every state not done, each step); their tokens."""
    states: list[ThinkerState] = []
    step = 0
    while step < 3 or any(not thinker.is_done(s) for s in states):
        if step in (0, 2):
            gen = request(SHORT, tokens=12) if step == 0 else request()
            states.append(thinker.prepare(gen, StageState({})))
        thinker.step([s for s in states if not thinker.is_done(s)])
        step += 1
    tokens = [s.generated.tolist() for s in states]
    for state in states:
        thinker.finish(state)
    return tokens


@pytest.mark.parametrize("decode", ["eager", "graphs"])
def test_a_prompt_joining_a_running_reply_in_chunks_picks_its_tokens(
    omni_model: Path, whole: Thinker, decode: str
) -> None:
    """Under the eager decode and the graphed one (run unrecorded on the CPU; recorded:
    tests/gpu/test_chunked_prefill_gpu.py): the joined prompt's first token comes from its last
    chunk and it decodes on as a row beside the running one."""
    thinker = Thinker.load(
        omni_model, CPU, torch.float32, max_slots=2, decode=decode, prefix_bytes=0, prefill_chunk_tokens=CHUNK
    )
    assert joined_run(thinker) == joined_run(whole)
    assert not thinker.slots.active


def head_positions(thinker: Thinker, gen: GenerationRequest) -> tuple[Run, int]:
    """A Run of `gen`, and the most positions any call of the thinker's output head computed."""
    positions: list[int] = []
    hook = thinker.model.lm_head.register_forward_hook(lambda _m, _i, out: positions.append(out.shape[1]))
    try:
        return Run(thinker, gen), max(positions)
    finally:
        hook.remove()


def test_on_cuda_a_prefill_computes_its_last_positions_logits_only(whole: Thinker, chunked: StepLog) -> None:
    """transformers' thinker ignores `logits_to_keep`: its head would run on every prompt token.
    On CUDA the prefill's head runs on the last position (here switched on, on the CPU): the
    same tokens, the first logits within rounding, and the model's own head back afterwards."""
    last = sibling(chunked, CHUNK)
    assert not last.last_position_head  # the CPU default: as transformers, bit for bit
    last.last_position_head = True
    head = chunked.model.lm_head
    before, every = head_positions(whole, request())
    after, one = head_positions(last, request())
    assert every > CHUNK and one == 1
    assert after.tokens == before.tokens
    assert largest(after.first_logits, before.first_logits) < TOL
    assert chunked.model.lm_head is head


def test_a_short_prompt_is_prefilled_at_admission_alone_and_by_the_next_step_beside_others(
    whole: Thinker, roomy: StepLog
) -> None:
    first = roomy.prepare(request(BURST[0], tokens=4), StageState({}))
    assert first.prefill is None, "alone, it is prefilled when admitted"
    second = roomy.prepare(request(BURST[1], tokens=4), StageState({}))
    assert second.prefill is not None and second.prefill.done == 0, "beside another, by the steps"
    picked = first.step_index
    roomy.step([first, second])
    assert second.prefill is None, "the next step prefilled it whole"
    assert first.step_index == picked + 1, "and the first reply picked its next token in it"
    while not (roomy.is_done(first) and roomy.is_done(second)):
        roomy.step([state for state in (first, second) if not roomy.is_done(state)])
    for state, prompt in ((first, BURST[0]), (second, BURST[1])):
        assert state.generated.tolist() == Run(whole, request(prompt, tokens=4)).tokens
        roomy.release(state)
    assert not roomy.slots.active


def test_a_running_reply_steps_between_the_prefills_of_a_burst_of_short_prompts(
    whole: Thinker, roomy: StepLog
) -> None:
    """Three prompts that each fit one chunk join a running reply at once, through the stage's
    scheduler: the steps prefill them one a step, and the running reply advances a token in
    each of those steps (prefilled when admitted, all three would run before its next step);
    every reply picks its lone run's tokens."""

    join_a_running_reply(roomy, [request(prompt, tokens=4) for prompt in BURST])
    prefills = [(i, state) for i, state in enumerate(roomy.prefilled) if state is not None]
    assert sorted(state.request.prompt for _, state in prefills) == sorted(BURST)
    running_at = [
        index for i, _ in prefills for state, index, _ in roomy.log[i] if state.request.prompt == SHORT
    ]
    assert len(running_at) == len(BURST), "the running reply stepped in every step that prefilled one"
    assert running_at == sorted(set(running_at)), "a token further each time"
    replies = {state.request.prompt: state.generated.tolist() for step in roomy.log for state, _, _ in step}
    for prompt, tokens in ((SHORT, 40), *((p, 4) for p in BURST)):
        assert replies[prompt] == Run(whole, request(prompt, tokens=tokens)).tokens, prompt
    assert not roomy.slots.active
