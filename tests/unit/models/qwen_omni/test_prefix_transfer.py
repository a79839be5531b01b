"""A prefix's KV moved from one thinker to another (the tiny Qwen2.5-Omni, CPU, fp32): the
receiver installs it, counts a hit and picks what a full prefill picks; a prefix of another
prompt is not installed (the prompt is computed in full), and one that does not fit the model
is INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omni_common.audio_input import inspect_audio
from omni_common.errors import InvalidArgument
from omni_common.input_media import input_audio_name
from omni_common.models.base import ChatTurn, GenerationRequest, StageState
from omni_common.models.prefix_cache import PrefixEntry
from omni_common.models.prefix_transfer import KEY, LENGTH, ROWS, KvShape, entry_of, prefix_state
from omni_common.models.qwen_omni.thinker import Thinker
from tests.unit.models.qwen_omni.test_prefix import CPU, FIRST, SECOND, clip, turn


@pytest.fixture(scope="module")
def pair(omni_model: Path) -> Iterator[tuple[Thinker, Thinker]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield (
        Thinker.load(omni_model, CPU, torch.float32, max_slots=2),
        Thinker.load(omni_model, CPU, torch.float32, max_slots=2),
    )
    torch.set_num_threads(threads)


def exported(thinker: Thinker, turns: tuple[ChatTurn, ...], audio: bytes) -> StageState:
    """What `thinker` exports of the prompt of `turns` (as StageRequest.export_prefix does)."""
    request = GenerationRequest(
        prompt="", messages=turns, audios=(inspect_audio(audio, index=0),), options=(("audio", "0"),)
    )
    tensors = {input_audio_name(0): torch.frombuffer(bytearray(audio), dtype=torch.uint8)}
    return thinker.export_prefix(request, StageState(tensors, {}))


def test_a_moved_prefix_is_a_hit_on_the_receiver_with_the_same_tokens(pair: tuple[Thinker, Thinker]) -> None:
    holder, receiver = pair
    audio = clip(1)
    receiver.prefixes.clear()
    uncached = turn(receiver, SECOND, audio)
    holder.prefixes.clear()
    receiver.prefixes.clear()
    assert exported(holder, SECOND, audio).tensors == {}  # nothing kept yet
    turn(holder, FIRST, audio)
    moved = exported(holder, SECOND, audio)
    assert int(moved.meta[LENGTH]) > 0 and ROWS in moved.tensors
    hits, holder_hits = receiver.prefix_stats().hits, holder.prefix_stats().hits
    assert turn(receiver, SECOND, audio, moved) == uncached
    assert receiver.prefix_stats().hits == hits + 1
    assert holder.prefix_stats().hits == holder_hits  # an export is not the holder's hit


def test_a_prefix_of_another_prompt_is_not_installed(pair: tuple[Thinker, Thinker]) -> None:
    holder, receiver = pair
    receiver.prefixes.clear()
    uncached = turn(receiver, SECOND, clip(2))
    holder.prefixes.clear()
    receiver.prefixes.clear()
    turn(holder, FIRST, clip(1))
    moved = exported(holder, SECOND, clip(1))  # same length, other audio: another key
    hits = receiver.prefix_stats().hits
    assert turn(receiver, SECOND, clip(2), moved) == uncached
    assert receiver.prefix_stats().hits == hits
    assert receiver.prefixes.stats.entries > 0  # its own prompt's, not the moved one


def spoiled(state: StageState, name: str, tensor: torch.Tensor | None) -> StageState:
    tensors = dict(state.tensors)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    return StageState(tensors, dict(state.meta))


def test_a_prefix_that_does_not_fit_the_model_is_invalid_argument(pair: tuple[Thinker, Thinker]) -> None:
    holder, receiver = pair
    audio = clip(3)
    holder.prefixes.clear()
    turn(holder, FIRST, audio)
    moved = exported(holder, SECOND, audio)
    keys = moved.tensors["prefix.keys.0"]
    broken = [
        spoiled(moved, "prefix.keys.0", None),  # a layer short
        spoiled(moved, "prefix.keys.0", keys.half()),
        spoiled(moved, "prefix.keys.0", keys[:, :, :-1]),
        spoiled(moved, "prefix.extra", keys),
        StageState(dict(moved.tensors), {**moved.meta, LENGTH: "many"}),
        StageState(dict(moved.tensors), {**moved.meta, KEY: "../etc"}),
    ]
    for state in broken:
        with pytest.raises(InvalidArgument):
            turn(receiver, SECOND, audio, state)
    assert receiver.slots.active == []  # refused before it took a slot


def test_entry_of_round_trips_a_prefix_state_as_copies() -> None:
    shape = KvShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, row_width=8)
    layer = torch.arange(1 * 2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    entry = PrefixEntry(3, (layer, layer + 1), (layer + 2, layer + 3), torch.ones(3, 8))
    state = prefix_state("a" * 64, entry)
    key, again = entry_of(state.tensors, state.meta, shape, CPU)
    assert key == "a" * 64 and again.length == 3
    pairs = zip(again.keys + again.values, entry.keys + entry.values, strict=True)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in pairs)
    assert again.rows is not None and torch.equal(again.rows, torch.ones(3, 8))
