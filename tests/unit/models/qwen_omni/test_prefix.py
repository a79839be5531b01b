"""The thinker's prefix cache in the runner: a prompt that extends an earlier one reuses its KV
and picks what a full prefill picks, a different audio clip of the same length is not taken for
the first, and new weights empty the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_common.audio_input import inspect_audio, wav_bytes
from omni_common.errors import InvalidArgument
from omni_common.input_media import input_audio_name
from omni_common.models.base import ChatTurn, GenerationRequest, StageState
from omni_common.models.qwen_omni.thinker import Thinker

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def thinker(omni_model: Path) -> Iterator[Thinker]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Thinker.load(omni_model, CPU, torch.float32, max_slots=2)
    torch.set_num_threads(threads)


def clip(seed: int) -> bytes:
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, 8000).astype(np.float32)
    return wav_bytes(noise, 16_000)


def turn(thinker: Thinker, turns: tuple[ChatTurn, ...], audio: bytes) -> list[int]:
    """Prefill and 4 greedy tokens (stepped alone); the tokens."""
    request = GenerationRequest(
        prompt="",
        messages=turns,
        audios=(inspect_audio(audio, index=0),),
        options=(("audio", "0"), ("max_new_tokens", "4")),
    )
    tensors = {input_audio_name(0): torch.frombuffer(bytearray(audio), dtype=torch.uint8)}
    state = thinker.prepare(request, StageState(tensors, {}))
    while not thinker.is_done(state):
        thinker.step([state])
    tokens = state.generated.tolist()
    thinker.finish(state)
    return tokens


FIRST = (ChatTurn("user", (("audio", 0), ("text", "Hello, who are you?"))),)
SECOND = (*FIRST, ChatTurn("assistant", (("text", "I am a test."),)), ChatTurn("user", (("text", "And?"),)))


def test_a_longer_prompt_reuses_the_prefix_and_picks_the_same_tokens(thinker: Thinker) -> None:
    thinker.prefixes.clear()
    audio = clip(1)
    uncached = turn(thinker, SECOND, audio)
    thinker.prefixes.clear()
    turn(thinker, FIRST, audio)
    hits = thinker.prefix_stats().hits
    assert turn(thinker, SECOND, audio) == uncached
    assert thinker.prefix_stats().hits == hits + 1


def test_another_clip_of_the_same_length_is_not_reused(thinker: Thinker) -> None:
    thinker.prefixes.clear()
    turn(thinker, FIRST, clip(1))
    hits = thinker.prefix_stats().hits
    turn(thinker, SECOND, clip(2))
    assert thinker.prefix_stats().hits == hits


def test_new_weights_empty_the_cache(thinker: Thinker) -> None:
    turn(thinker, FIRST, clip(1))
    assert thinker.prefix_stats().entries > 0
    thinker.weights_changed()
    assert thinker.prefix_stats().entries == 0 and thinker.prefix_stats().bytes == 0


def test_the_processor_has_no_video_part_and_says_so(thinker: Thinker) -> None:
    """The video part is a stand-in (transformers' needs torchvision): the processor still
    prints, and frames get a clear refusal."""
    assert "NoVideoProcessor" in repr(thinker.processor)
    with pytest.raises(InvalidArgument, match="not video"):
        thinker.processor.video_processor(videos=[np.zeros((2, 28, 28, 3), np.uint8)])
