"""A DiT spread over two gloo worker processes (sequence parallel, CFG parallel) against the
same denoiser in one process: same requests, same inputs, every step.

Not bitwise: the ranks attend with their share of the heads and CFG parallel runs each branch
as a forward of its own (the one-process batch pads both branches' prompts to one length), so
sums run in another order. Measured here (tiny fixture, fp32): at most 1.2e-6 on the latents.
The tiny fixture's 3 heads split 2 + 1 over the two ranks, so uneven head shares are covered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_common.errors import InvalidArgument, OmniError, Unavailable, Unimplemented
from omni_common.models.base import GenerationRequest, LateFlag, StageState
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.runtime.calls import StageCall
from omni_common.runtime.config import StageConfig
from omni_common.runtime.group_runner import GroupRunner
from omni_common.runtime.parallel_mode import ParallelPolicy
from omni_common.runtime.rank_commands import Read
from omni_common.runtime.step_scheduler import StepScheduler
from omni_common.runtime.worker_group import Sent, WorkerGroup

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5  # fp32 latents after 4 steps; the measured worst is 1.2e-6
# Every request over both ranks (sequence parallel; CFG parallel with CFG), whatever its size:
# the tiny fixture's images are far below --parallel-mode auto's thresholds.
SPLIT = ParallelPolicy("sequence-parallel")


@pytest.fixture(scope="module")
def group(tiny_model: Path) -> Iterator[WorkerGroup]:
    config = StageConfig(stage="dit-denoise", model_dir=tiny_model, devices=("cpu", "cpu"), threads=1)
    started = WorkerGroup(config, "denoise")
    yield started
    started.close()


@pytest.fixture(scope="module")
def local(tiny_model: Path) -> QwenImageDenoiser:
    return QwenImageDenoiser.load(tiny_model, torch.device("cpu"), torch.float32)


def requests(cfg: bool, count: int, **options: str) -> list[tuple[GenerationRequest, StageState]]:
    """Requests of different prompt lengths (so a batch pads and masks) with their inputs."""
    made = []
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {"prompt_embeds": torch.randn(1, 5 + 3 * i, 16, generator=generator)}
        if cfg:
            tensors["negative_prompt_embeds"] = torch.randn(1, 4, 16, generator=generator)
        request = GenerationRequest(
            prompt=f"p{i}",
            negative_prompt="blurry" if cfg else "",
            width=64,
            height=48,
            num_inference_steps=4,
            seed=i,
            options=tuple(options.items()),
        )
        made.append((request, StageState(tensors)))
    return made


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("count", [1, 2], ids=["alone", "batched"])
def test_two_ranks_step_like_one_process(
    group: WorkerGroup, local: QwenImageDenoiser, cfg: bool, count: int
) -> None:
    runner = GroupRunner(group, SPLIT)
    work = requests(cfg, count)
    spread = [runner.prepare(request, inputs) for request, inputs in work]
    alone = [local.prepare(request, inputs) for request, inputs in work]
    assert [runner.batch_key(s) for s in spread] == [local.batch_key(s) for s in alone]
    while not runner.is_done(spread[0]):
        runner.step(spread)
        local.step(alone)
        assert [s.step_index for s in spread] == [s.step_index for s in alone]
        assert all(runner.is_finite(s) for s in spread)
    outputs = [runner.finish(state) for state in spread]
    worst = max(
        float((out.tensors["latents"] - state.latents).abs().max())
        for out, state in zip(outputs, alone, strict=True)
    )
    print(f"max |2 ranks - 1 process| on the latents (cfg={cfg}, requests={count}): {worst:.3g}")
    assert worst <= TOLERANCE
    assert all(out.meta == {"height": "48", "width": "64"} for out in outputs)


def test_compiled_blocks_trace_the_collectives(tiny_model: Path, local: QwenImageDenoiser) -> None:
    """torch.compile (fullgraph) of the blocks with the all-to-alls inside, as on GPUs (auto):
    the latents of one eager process, with and without CFG."""
    config = StageConfig(
        stage="dit-denoise", model_dir=tiny_model, devices=("cpu", "cpu"), threads=1, compile="on"
    )
    compiled = WorkerGroup(config, "denoise")
    try:
        runner = GroupRunner(compiled, SPLIT)
        for cfg in (False, True):
            ((request, inputs),) = requests(cfg, 1)
            spread, alone = runner.prepare(request, inputs), local.prepare(request, inputs)
            while not local.is_done(alone):
                runner.step([spread])
                local.step([alone])
            latents = runner.finish(spread).tensors["latents"]
            assert float((latents - alone.latents).abs().max()) <= TOLERANCE, cfg
    finally:
        compiled.close()


def test_compiled_spread_blocks_compile_once_for_every_prompt_length(
    tiny_model: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of new lengths after the first two (which make the length dynamic) run the
    compiled spread blocks without compiling again: the ranks' recompile log stays empty. (A
    prompt length kept as a Python value, read inside the blocks, compiled them again for each
    length: 6-7 s a prompt at 1024x1024 on 2 H100s.)"""
    monkeypatch.setenv("TORCH_LOGS", "recompiles")  # the ranks log each recompile to stderr
    config = StageConfig(
        stage="dit-denoise", model_dir=tiny_model, devices=("cpu", "cpu"), threads=1, compile="on"
    )
    compiled = WorkerGroup(config, "denoise")

    def run(length: int) -> None:
        request = GenerationRequest(prompt="p", width=64, height=48, num_inference_steps=2, seed=1)
        inputs = StageState({"prompt_embeds": torch.randn(1, length, 16, generator=torch.Generator())})
        state = runner.prepare(request, inputs)
        while not runner.is_done(state):
            runner.step([state])
        runner.finish(state)

    try:
        runner = GroupRunner(compiled, SPLIT)
        run(5)
        run(8)
        warm = capfd.readouterr().err
        for length in (11, 23):
            run(length)
        later = capfd.readouterr().err
    finally:
        compiled.close()
    assert "Recompiling function" in warm  # the second length made it dynamic
    assert "Recompiling function" not in later, later[-2000:]


def test_checkpoints_move_between_the_group_and_one_process(
    group: WorkerGroup, local: QwenImageDenoiser
) -> None:
    runner = GroupRunner(group, SPLIT)
    ((request, inputs),) = requests(True, 1)
    spread, alone = runner.prepare(request, inputs), local.prepare(request, inputs)
    runner.step([spread])
    runner.step([spread])
    checkpoint = runner.checkpoint(spread)
    assert checkpoint is not None and checkpoint.meta["step_index"] == "2"
    local.restore(alone, checkpoint)  # the group's state continues in one process...
    resumed = runner.prepare(request, inputs)
    runner.restore(resumed, local.checkpoint(alone))  # ...and one process's in the group
    assert resumed.step_index == 2
    while not local.is_done(alone):
        local.step([alone])
        runner.step([resumed])
    preview = runner.preview(resumed)
    assert preview is not None and preview.shape == (12, 16, 3)
    latents = runner.finish(resumed).tensors["latents"]
    assert float((latents - alone.latents).abs().max()) <= TOLERANCE
    runner.release(spread)


def test_a_bad_request_fails_alone_and_the_group_serves_on(group: WorkerGroup) -> None:
    runner = GroupRunner(group, SPLIT)
    ((request, _),) = requests(True, 1)
    with pytest.raises(InvalidArgument, match="negative_prompt_embeds"):
        runner.prepare(request, StageState({"prompt_embeds": torch.randn(1, 5, 16)}))
    ((cached, inputs),) = requests(False, 1, step_cache="0.1")
    with pytest.raises(Unimplemented, match="step_cache is not available on a replica spread over 2"):
        runner.prepare(cached, inputs)
    with pytest.raises(Unimplemented, match="LoRA adapters are not available on a dit-denoise replica over"):
        runner.prepare(replace(cached, options=(), loras=(("ink", 1.0),)), inputs)
    ((fine, inputs),) = requests(False, 1)
    state = runner.prepare(fine, inputs)
    runner.step([state])
    assert state.step_index == 1


def test_steps_are_sent_ahead_and_each_command_gets_its_own_answer(
    group: WorkerGroup, local: QwenImageDenoiser
) -> None:
    """A Step returns once sent; its answer is read later, after later commands were sent. Reading
    a later command's answers first keeps the earlier ones for their readers, and an error
    answered to one command is raised to its reader only."""
    runner = GroupRunner(group, SPLIT)
    ((request, inputs),) = requests(True, 1)
    spread, alone = runner.prepare(request, inputs), local.prepare(request, inputs)
    flags = []
    for _ in range(2):
        runner.step([spread])
        flags.append(runner.is_finite(spread))
    assert spread.step_index == 2  # counted at the send
    bad = group.send(Read(10**9, "checkpoint"), ranks=[0])  # no such state: the rank fails it
    runner.step([spread])
    flags.append(runner.is_finite(spread))
    assert all(isinstance(flag, LateFlag) for flag in flags)
    assert flags[2].read() and flags[0].read() and flags[1].read()  # the last first
    with pytest.raises(OmniError, match="internal error in a device worker"):
        group.answers(bad)
    for _ in range(3):
        local.step([alone])
    latents = runner.finish(spread).tensors["latents"]
    assert float((latents - alone.latents).abs().max()) <= TOLERANCE


def scheduled(runner: GroupRunner, call: StageCall) -> StageState:
    """`call`'s result through a StepScheduler over `runner` (its server device is the CPU)."""

    async def main() -> StageState:
        executor = ThreadPoolExecutor(max_workers=1)

        async def compute(fn: Callable[..., Any], *args: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

        scheduler = StepScheduler(runner, compute)
        try:
            async for event in scheduler.run(call):
                if isinstance(event, StageState):
                    return event
            raise AssertionError("no result")
        finally:
            scheduler.close()
            executor.shutdown()

    return asyncio.run(main())


def test_the_scheduler_sends_each_step_before_reading_the_last_ones_answer(
    group: WorkerGroup, local: QwenImageDenoiser
) -> None:
    """The StepScheduler over the group (its server device is the CPU): step k+1 is with the
    ranks before step k's answers are read, so a rank finds its next step waiting."""
    ((request, inputs),) = requests(True, 1)
    runner, unread = GroupRunner(group, SPLIT), []
    send = group.send

    def counted(*args: Any, **kwargs: Any) -> Sent:
        sent = send(*args, **kwargs)
        unread.append(len(group._unread[0]))  # this command and those before it not yet read
        return sent

    group.send = counted  # type: ignore[method-assign]
    try:
        result = scheduled(runner, StageCall(request_id="r", request=request, inputs=inputs))
    finally:
        del group.send
    assert max(unread) >= 2, unread
    state = local.prepare(request, inputs)
    while not local.is_done(state):
        local.step([state])
    assert float((result.tensors["latents"] - state.latents).abs().max()) <= TOLERANCE


def test_a_dead_rank_loses_the_group(tiny_model: Path) -> None:
    config = StageConfig(stage="dit-denoise", model_dir=tiny_model, devices=("cpu", "cpu"), threads=1)
    doomed = WorkerGroup(config, "denoise")
    lost: list[str] = []
    doomed.on_lost = lost.append
    try:
        runner = GroupRunner(doomed, SPLIT)
        ((request, inputs),) = requests(False, 1)
        state = runner.prepare(request, inputs)
        pid = doomed.processes[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Unavailable, match="lost a device worker"):
            runner.step([state])  # sent (or refused, if the group already knows)...
            runner.is_finite(state).read()  # ...its answer never comes
        deadline = time.monotonic() + 10
        while (not lost or doomed.processes[0].is_alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and ("exited" in lost[0] or "gone" in lost[0])
        assert not doomed.processes[0].is_alive(), "the surviving rank was left waiting for its peer"
        with pytest.raises(Unavailable):
            runner.prepare(request, inputs)
    finally:
        doomed.close()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The ranks run one thread each: so does the reference here, for the same summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_data_parallel_requests_each_run_on_one_rank_bitwise_as_on_one_device(
    group: WorkerGroup, local: QwenImageDenoiser, cfg: bool
) -> None:
    runner = GroupRunner(group, ParallelPolicy("data-parallel"))
    work = requests(cfg, 2)
    spread = [runner.prepare(request, inputs) for request, inputs in work]
    assert [state.ranks for state in spread] == [(0,), (1,)]  # the least loaded rank each
    assert runner.modes.last == "data-parallel"
    assert runner.batch_key(spread[0]) == runner.batch_key(spread[1])  # one Step for both ranks
    while not runner.is_done(spread[0]):
        runner.step(spread)
    for state, (request, inputs) in zip(spread, work, strict=True):
        alone = local.prepare(request, inputs)  # each request alone on one device
        while not local.is_done(alone):
            local.step([alone])
        preview = runner.preview(state)
        assert preview is not None and np.array_equal(preview, local.preview(alone))
        assert torch.equal(runner.finish(state).tensors["latents"], alone.latents)


def test_auto_splits_a_large_request_and_keeps_small_ones_on_one_rank(
    group: WorkerGroup, local: QwenImageDenoiser
) -> None:
    """Thresholds lowered to the tiny images: a lone CFG request runs CFG parallel (the latents
    of the one-device run, as sequence parallel's are), the next one in flight on one rank."""
    policy = ParallelPolicy(cfg_parallel_tokens=1, sequence_parallel_tokens=1)
    runner = GroupRunner(group, policy)
    (first, second) = requests(True, 2)
    split = runner.prepare(*first)
    assert split.ranks == (0, 1) and runner.modes.last == "cfg-parallel"
    apart = runner.prepare(*second)
    assert apart.ranks == (0,) and runner.modes.last == "data-parallel"
    assert runner.batch_key(split) != runner.batch_key(apart)  # never one Step
    alone = local.prepare(*first)
    while not runner.is_done(split):
        runner.step([split])
        local.step([alone])
    assert float((runner.finish(split).tensors["latents"] - alone.latents).abs().max()) <= TOLERANCE
    checkpoint = runner.checkpoint(apart)  # read from the rank that holds it
    assert checkpoint is not None and checkpoint.meta["step_index"] == "0"
    runner.release(apart)
    assert runner.prepare(*second).ranks == (0, 1)  # alone again: split


@pytest.mark.usefixtures("one_thread")
def test_a_burst_s_first_request_starts_on_one_rank(group: WorkerGroup, local: QwenImageDenoiser) -> None:
    """Thresholds lowered to the tiny images, so that a lone request spreads: one whose call
    announces a follower (the coordinator's count of requests like it still in the steps
    before) starts on one rank through the scheduler, leaving the other rank to the follower,
    and runs there bitwise as on one device."""
    ((request, inputs),) = requests(False, 1)
    runner = GroupRunner(group, ParallelPolicy(cfg_parallel_tokens=1, sequence_parallel_tokens=1))
    lone = scheduled(runner, StageCall(request_id="lone", request=request, inputs=inputs))
    assert runner.modes.last == "sequence-parallel"
    burst = scheduled(runner, StageCall(request_id="first", request=request, inputs=inputs, followers=1))
    assert runner.modes.last == "data-parallel"
    state = local.prepare(request, inputs)
    while not local.is_done(state):
        local.step([state])
    assert torch.equal(burst.tensors["latents"], state.latents)
    assert float((lone.tensors["latents"] - state.latents).abs().max()) <= TOLERANCE
