"""The thinker's prefix cache in the runner: a prompt that extends an earlier one reuses its KV
and picks what a full prefill picks, a different audio clip of the same length is not taken for
the first, nor is a video of other frames, and new weights empty the cache."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_common.audio_input import inspect_audio, wav_bytes
from omni_common.input_media import input_audio_name, input_video_name
from omni_common.models.base import ChatTurn, GenerationRequest, StageState
from omni_common.models.qwen_omni.processor import ThinkerPrompt, reference_inputs
from omni_common.models.qwen_omni.reference import one_turn
from omni_common.models.qwen_omni.thinker import Thinker
from omni_common.video_input import canonical_video, inspect_video
from omnistage.v1 import coordinator_pb2 as cpb

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


def turn(
    thinker: Thinker, turns: tuple[ChatTurn, ...], audio: bytes, moved: StageState | None = None
) -> list[int]:
    """Prefill and 4 greedy tokens (stepped alone), with a prefix `moved` from another thinker
    among the inputs (prefix_transfer.py) when given; the tokens."""
    request = GenerationRequest(
        prompt="",
        messages=turns,
        audios=(inspect_audio(audio, index=0),),
        options=(("audio", "0"), ("max_new_tokens", "4")),
    )
    tensors = {input_audio_name(0): torch.frombuffer(bytearray(audio), dtype=torch.uint8)}
    extra = moved or StageState({}, {})
    state = thinker.prepare(request, StageState(tensors | extra.tensors, dict(extra.meta)))
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


def test_the_processor_prints_and_its_video_part_makes_the_thinkers_inputs(thinker: Thinker) -> None:
    """The video part is omnistage's frame processor (transformers' needs torchvision): the
    processor still prints, and frames become the inputs the thinker's forward names."""
    assert "OmniProcessor" in repr(thinker.processor)
    frames = [Image.new("RGB", (56, 56), (i * 40, 0, 0)) for i in range(3)]
    out = thinker.processor.video_processor(videos=[frames], return_tensors="pt")
    assert set(out) == {"pixel_values_videos", "video_grid_thw"}
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]  # 3 frames -> 2 temporal patches


def video_turn(thinker: Thinker, turns: tuple[ChatTurn, ...], video: bytes) -> list[int]:
    """As `turn`, with one input video (a serialized InputVideo) instead of a clip."""
    request = GenerationRequest(
        prompt="",
        messages=turns,
        videos=(inspect_video(video, index=0, max_pixels=1 << 22),),
        options=(("audio", "0"), ("max_new_tokens", "4")),
    )
    tensors = {input_video_name(0): torch.frombuffer(bytearray(video), dtype=torch.uint8)}
    state = thinker.prepare(request, StageState(tensors, {}))
    while not thinker.is_done(state):
        thinker.step([state])
    tokens = state.generated.tolist()
    thinker.finish(state)
    return tokens


def video(seed: int, count: int = 2, fps: float = 2.0) -> bytes:
    """A serialized InputVideo of `count` 28x28 noise frames."""
    pixels = np.random.default_rng(seed).integers(0, 256, (count, 28, 28, 3), dtype=np.uint8)
    encoded = []
    for frame in pixels:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    return canonical_video(cpb.InputVideo(frames=encoded, fps=fps))


VIDEO_FIRST = (ChatTurn("user", (("video", 0), ("text", "Hello, who are you?"))),)
VIDEO_SECOND = (
    *VIDEO_FIRST,
    ChatTurn("assistant", (("text", "I am a test."),)),
    ChatTurn("user", (("text", "And?"),)),
)


def test_a_video_prefix_is_reused_for_its_own_frames_only(thinker: Thinker) -> None:
    thinker.prefixes.clear()
    uncached = video_turn(thinker, VIDEO_SECOND, video(1))
    thinker.prefixes.clear()
    video_turn(thinker, VIDEO_FIRST, video(1))
    hits = thinker.prefix_stats().hits
    assert video_turn(thinker, VIDEO_SECOND, video(1)) == uncached
    assert thinker.prefix_stats().hits == hits + 1
    video_turn(thinker, VIDEO_FIRST, video(2))
    hits = thinker.prefix_stats().hits
    video_turn(thinker, VIDEO_SECOND, video(3))  # same tokens, other frames
    assert thinker.prefix_stats().hits == hits


def test_the_thinkers_video_prompt_equals_the_processors_with_its_rate(thinker: Thinker) -> None:
    """The frames, the placeholders and the rope positions (the rate sets them: 2 / fps seconds a
    temporal patch) equal transformers' processor called with that fps, for a rate other than
    its default."""
    positions = {}
    for fps in (2.0, 0.5):
        data = video(4, count=5, fps=fps)  # 3 temporal patches, the last padded
        frames = list(cpb.InputVideo.FromString(data).frames)
        seen = inspect_video(data, index=0, max_pixels=1 << 22)
        request = GenerationRequest(prompt="What?", videos=(seen,))
        tensors = {input_video_name(0): torch.frombuffer(bytearray(data), dtype=torch.uint8)}
        prompt = ThinkerPrompt.of(thinker.processor, thinker.model, request, tensors, CPU)
        ref = reference_inputs(thinker.processor, one_turn("What?", videos=1), videos=[(frames, fps)])
        assert torch.equal(prompt.input_ids, ref["input_ids"])
        assert torch.equal(prompt.media["pixel_values_videos"], ref["pixel_values_videos"])
        expected, delta = thinker.model.get_rope_index(
            ref["input_ids"],
            None,
            ref["video_grid_thw"],
            ref["attention_mask"],
            False,
            None,
            ref["video_second_per_grid"],
        )
        assert torch.equal(prompt.positions[1:], expected) and prompt.rope_delta == int(delta)
        positions[fps] = expected
    assert not torch.equal(positions[2.0], positions[0.5])


def test_turns_leave_no_autograd_history_in_the_slots_or_the_kept_prefixes(thinker: Thinker) -> None:
    """A served model records no autograd graph: a KV slot written in place, or a kept prefix,
    with one would keep every activation of its prefill alive (and, through each later write,
    those of the prefills before it): ~12 GiB a 2,000-token prompt at real size."""
    thinker.prefixes.clear()
    audio = clip(3)
    turn(thinker, FIRST, audio)
    turn(thinker, SECOND, audio)  # reuses FIRST's prefix, installs nothing new by hand
    assert not any(p.requires_grad for p in thinker.model.parameters())
    slots = [*thinker.slots.keys, *thinker.slots.values]
    assert slots and all(t.grad_fn is None and not t.requires_grad for t in slots)
    kept = [t for entry in thinker.prefixes._entries.values() for t in (*entry.keys, *entry.values)]
    assert kept and all(t.grad_fn is None for t in kept)
