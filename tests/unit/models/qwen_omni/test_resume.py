"""The talker and token2wav resume from their checkpoints: a state stepped part way, then given
up, and a fresh state restored from its checkpoint on the same runner (as a replica that takes
over) and fed its input stream again from the start, make together exactly the chunks of an
uninterrupted run; bad checkpoints are INVALID_ARGUMENT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwen_omni.talker import Talker
from omni_common.models.qwen_omni.thinker import Thinker
from omni_common.models.qwen_omni.token2wav import Token2Wav
from tests.unit.models.qwen_omni.test_runners import CPU, one_thread, request, run_role

__all__ = ["one_thread"]  # its fixture: one CPU thread, as the reference runs


@pytest.fixture(scope="module")
def models(omni_model: Path) -> tuple[Thinker, Talker, Token2Wav]:
    return (
        Thinker.load(omni_model, CPU, torch.float32),
        Talker.load(omni_model, CPU, torch.float32),
        Token2Wav.load(omni_model, CPU),
    )


def start(runner: Any, gen: GenerationRequest, chunks: list[StageState], feed: bool = True) -> Any:
    state = runner.prepare(gen, chunks[0])
    if feed:
        for chunk in chunks[1:]:
            runner.feed(state, chunk, False)
        runner.feed(state, StageState({}), True)
    return state


def run_until_checkpoint(
    runner: Any, gen: GenerationRequest, chunks: list[StageState], at: int
) -> tuple[list[StageState], StageState]:
    """Step one state as the scheduler does (a chunk, then a checkpoint, after each step) until
    its `at`-th checkpoint; its chunks so far and that checkpoint. The state is then given up."""
    state, out, taken = start(runner, gen, chunks), [], 0
    while True:
        runner.step([state])
        if (partial := runner.take_partial(state)) is not None:
            out.append(partial)
        checkpoint = runner.checkpoint(state)
        taken += checkpoint is not None
        if taken == at:
            runner.release(state)
            return out, checkpoint
        assert not runner.is_done(state), "the run ended before the checkpoint"


def resumed(
    runner: Any, gen: GenerationRequest, chunks: list[StageState], checkpoint: StageState
) -> list[StageState]:
    """A fresh state restored from `checkpoint`, fed the stream again from its start, run out."""
    state = start(runner, gen, chunks, feed=False)
    runner.restore(state, checkpoint)
    assert len(chunks) == 1 or not runner.ready(state), "ready before its stream came again"
    for chunk in chunks[1:]:
        runner.feed(state, chunk, False)
    runner.feed(state, StageState({}), True)
    out = []
    while not runner.is_done(state):
        runner.step([state])
        if (partial := runner.take_partial(state)) is not None:
            out.append(partial)
    runner.finish(state)
    return out


def assert_same_chunks(got: list[StageState], want: list[StageState]) -> None:
    assert [c.meta for c in got] == [c.meta for c in want]
    for a, b in zip(got, want, strict=True):
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name]), name


# Every 5 codes, as the coordinator asks: the 2nd checkpoint is within the thinker's rows,
# the 9th past them (its text-eos and text-pad rows replayed too).
@pytest.mark.parametrize("at", [2, 9])
def test_a_talker_restored_from_a_checkpoint_says_the_uninterrupted_codes(
    models: tuple[Thinker, Talker, Token2Wav], at: int
) -> None:
    thinker, talker, _ = models
    gen = request(seed=5, stream_audio=1)
    (rows,) = run_role(thinker, [gen], [[]])
    (want,) = run_role(talker, [gen], [rows])
    before, checkpoint = run_until_checkpoint(_every(talker, 5), gen, rows, at)
    assert int(checkpoint.tensors["codes"].numel()) == 5 * at
    after = resumed(talker, gen, rows, checkpoint)
    assert_same_chunks(before[: int(checkpoint.meta["chunks_sent"])] + after, want)
    assert not talker.slots.active


def test_token2wav_restored_from_a_checkpoint_makes_the_uninterrupted_mel(
    models: tuple[Thinker, Talker, Token2Wav],
) -> None:
    thinker, talker, token2wav = models
    gen = request(seed=6, stream_audio=1)
    (rows,) = run_role(thinker, [gen], [[]])
    (codes,) = run_role(talker, [gen], [rows])
    (want,) = run_role(token2wav, [gen], [codes])
    before, checkpoint = run_until_checkpoint(token2wav, gen, codes, at=2)
    assert int(checkpoint.meta["frames_done"]) > 0 and len(want) > 2
    after = resumed(token2wav, gen, codes, checkpoint)
    assert_same_chunks(before + after, want)


def test_token2wav_resumes_from_a_checkpoint_taken_with_later_windows_open(
    models: tuple[Thinker, Talker, Token2Wav],
) -> None:
    """Codes coming 7 a step, so that windows are solved together: a checkpoint taken as one
    closes while the next is open holds all the noise drawn and the generator after it; a state
    restored from it solves the open windows again from the same noise and makes the
    uninterrupted chunks (up to the rounding of rows batched differently)."""
    token2wav = models[2]
    gen = request(seed=8, stream_audio=1)
    codes = torch.randint(0, token2wav.codes_limit, (300,), generator=torch.Generator().manual_seed(8))
    pieces = [StageState({"codes": piece}) for piece in codes.split(7)]
    want = run_role(token2wav, [gen], [pieces])[0]
    state, before, fed = start(token2wav, gen, pieces[:1], feed=False), [], 1
    while True:
        assert fed < len(pieces), "no checkpoint came with a window open"
        token2wav.feed(state, pieces[fed], False)
        fed += 1
        token2wav.step([state])
        before.extend([] if (partial := token2wav.take_partial(state)) is None else [partial])
        checkpoint = token2wav.checkpoint(state)
        if checkpoint is not None and state.windows:
            break
    token2wav.release(state)
    after = resumed(token2wav, gen, pieces, checkpoint)
    got = before[: int(checkpoint.meta["chunks_sent"])] + after
    assert [c.meta for c in got] == [c.meta for c in want] and len(want) == 9
    for a, b in zip(got, want, strict=True):
        for name in b.tensors:
            torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=1e-5)


def test_a_one_shot_token2wav_gives_no_checkpoint(models: tuple[Thinker, Talker, Token2Wav]) -> None:
    """Its one window ends the request: a checkpoint of it would only restart it."""
    thinker, talker, token2wav = models
    gen = request(seed=6, stream_audio=0)
    (rows,) = run_role(thinker, [gen], [[]])
    (codes,) = run_role(talker, [gen], [rows])
    state, checkpoints = start(token2wav, gen, codes), []
    while not token2wav.is_done(state):
        token2wav.step([state])
        token2wav.take_partial(state)
        checkpoints.append(token2wav.checkpoint(state))
    token2wav.finish(state)
    assert len(checkpoints) > 1 and checkpoints == [None] * len(checkpoints)


def test_bad_checkpoints_are_invalid(models: tuple[Thinker, Talker, Token2Wav]) -> None:
    thinker, talker, token2wav = models
    gen = request(seed=5, stream_audio=1)
    (rows,) = run_role(thinker, [gen], [[]])
    _, checkpoint = run_until_checkpoint(_every(talker, 5), gen, rows, 1)
    other = StageState({**checkpoint.tensors, "codes": checkpoint.tensors["codes"] + 1}, checkpoint.meta)
    for bad, match in [
        (other, "another request"),
        (StageState({}), "codes"),
        (_without(checkpoint, "generator"), "generator"),
    ]:
        state = talker.prepare(gen, rows[0])
        with pytest.raises(InvalidArgument, match=match):
            talker.restore(state, bad)
        talker.release(state)
    window = token2wav.prepare(gen, StageState({}))
    with pytest.raises(InvalidArgument, match="frames_done"):
        token2wav.restore(window, StageState({}, {"frames_done": "-1"}))
    assert not talker.slots.active


class _every:
    """`runner` whose `checkpoint` gives one every `every` steps (the scheduler's rule)."""

    def __init__(self, runner: Any, every: int) -> None:
        self.runner, self.every = runner, every

    def checkpoint(self, state: Any) -> StageState | None:
        return self.runner.checkpoint(state) if state.step_index % self.every == 0 else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def _without(checkpoint: StageState, name: str) -> StageState:
    return StageState({k: v for k, v in checkpoint.tensors.items() if k != name}, checkpoint.meta)
