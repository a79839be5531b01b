"""The thinker's short prefills as graphed extends (graphed_extend.py), run unrecorded on the
CPU (tiny fixture, float32) next to the eager prefill: a short text prompt, and a conversation's
next turn after a reused prefix that holds an audio clip (rope positions past the clip), pick
the eager prefill's greedy tokens, with the talker rows, KV and first logits within float
rounding (another attention call: a masked SDPA over the slot's row). A prompt longer than the
largest bucket, or a chunk holding a clip, takes the eager prefill. The recorded form runs on a
GPU: tests/gpu/test_graphed_extend_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_common.audio_input import inspect_audio, wav_bytes
from omni_common.input_media import input_audio_name
from omni_common.models.base import ChatTurn, GenerationRequest, StageState
from omni_common.models.graphed_extend import EXTEND_BUCKETS
from omni_common.models.qwen_omni.thinker import Thinker

CPU = torch.device("cpu")
TOL = 1e-5  # measured here: rows 2.4e-7, logits 6e-8, keys and values 3e-8 at most
LONG = " ".join(f"Sentence {i} of a long prompt about boats, rivers and the sea." for i in range(8))
FIRST = (ChatTurn("user", (("audio", 0), ("text", "Hello, who are you?"))),)
SECOND = (*FIRST, ChatTurn("assistant", (("text", "I am a test."),)), ChatTurn("user", (("text", "And?"),)))


@pytest.fixture(scope="module")
def pair(omni_model: Path) -> Iterator[tuple[Thinker, Thinker]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    load = {"max_slots": 2, "max_tokens": 1024}
    eager = Thinker.load(omni_model, CPU, torch.float32, decode="eager", **load)  # type: ignore[arg-type]
    graphed = Thinker.load(omni_model, CPU, torch.float32, decode="graphs", **load)  # type: ignore[arg-type]
    assert graphed.extend is not None and eager.extend is None
    yield eager, graphed
    torch.set_num_threads(threads)


def clip() -> bytes:
    return wav_bytes(np.random.default_rng(1).uniform(-0.5, 0.5, 8000).astype(np.float32), 16_000)


def request(prompt: str = "", turns: tuple[ChatTurn, ...] = ()) -> GenerationRequest:
    """A greedy spoken reply of 5 tokens (spoken: the prefill keeps the talker's rows)."""
    options = (("audio", "1"), ("max_new_tokens", "5"), ("thinker_do_sample", "0"))
    audios = (inspect_audio(clip(), index=0),) if turns else ()
    return GenerationRequest(prompt=prompt, messages=turns, audios=audios, seed=1, options=options)


class Reply:
    """One request stepped alone: its first logits, talker rows, KV after the prefill, tokens."""

    def __init__(self, thinker: Thinker, gen: GenerationRequest) -> None:
        logits: list[torch.Tensor] = []
        hook = thinker.model.lm_head.register_forward_hook(
            lambda _m, _i, out: logits.append(out.reshape(-1, out.shape[-1])[-1:].detach())
        )
        extend = thinker.extend
        if extend is not None:  # a replayed graph runs no hook: take the extend's own logits
            run = extend.run

            def recording(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                out = run(*args)
                logits.append(out[2])
                return out

            extend.run = recording  # type: ignore[method-assign]
        tensors = {input_audio_name(0): torch.frombuffer(bytearray(clip()), dtype=torch.uint8)}
        try:
            state = thinker.prepare(gen, StageState(tensors if gen.audios else {}))
        finally:
            hook.remove()
            if extend is not None:
                del extend.run  # the class's again
        assert state.prefill is None  # prefilled at admission
        self.first_logits = logits[-1]
        self.rows = state.first["prompt"]
        self.keys, self.values = thinker.slots.read(state.slot)
        while not thinker.is_done(state):
            thinker.step([state])
        self.tokens = state.generated.tolist()
        thinker.finish(state)

    def assert_like(self, other: Reply) -> None:
        errors = {
            "rows": largest([self.rows], [other.rows]),
            "logits": largest([self.first_logits], [other.first_logits]),
            "keys": largest(self.keys, other.keys),
            "values": largest(self.values, other.values),
        }
        assert self.tokens == other.tokens
        assert max(errors.values()) < TOL, errors


def largest(
    a: tuple[torch.Tensor, ...] | list[torch.Tensor], b: tuple[torch.Tensor, ...] | list[torch.Tensor]
) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_a_short_text_prompt_runs_as_one_extend_and_matches_the_eager_prefill(
    pair: tuple[Thinker, Thinker],
) -> None:
    eager, graphed = pair
    assert graphed.extend is not None
    runs = graphed.extend.runs
    graphed_reply = Reply(graphed, request("Tell me a short story."))
    assert graphed.extend.runs == runs + 1
    graphed_reply.assert_like(Reply(eager, request("Tell me a short story.")))


def test_a_turn_after_a_reused_prefix_with_a_clip_extends_from_the_prefix(
    pair: tuple[Thinker, Thinker],
) -> None:
    eager, graphed = pair
    assert graphed.extend is not None
    for thinker in pair:
        thinker.prefixes.clear()
        Reply(thinker, request(turns=FIRST))  # the clip's turn: the eager prefill, kept
    runs, hits = graphed.extend.runs, graphed.prefix_stats().hits
    graphed_reply = Reply(graphed, request(turns=SECOND))
    assert graphed.prefix_stats().hits == hits + 1 and graphed.extend.runs == runs + 1
    graphed_reply.assert_like(Reply(eager, request(turns=SECOND)))


def test_longer_prompts_and_chunks_with_media_take_the_eager_prefill(pair: tuple[Thinker, Thinker]) -> None:
    _, graphed = pair
    assert graphed.extend is not None
    graphed.prefixes.clear()
    runs = graphed.extend.runs
    long = Reply(graphed, request(LONG))
    assert len(long.keys[0][0, 0]) > EXTEND_BUCKETS[-1]
    Reply(graphed, request(turns=FIRST))
    assert graphed.extend.runs == runs
