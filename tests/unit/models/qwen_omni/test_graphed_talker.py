"""The talker's graphed decode (graphed_decode.py with DecodeIO: each step's input is the code's
embedding plus the thinker row the host sets, the repetition penalty from a mask of the codes
each row has seen), run unrecorded on the CPU (tiny fixture, float32): fed the thinker's
chunks as the stage streams them, it picks the eager talker's codes, greedy and sampled, alone
and three requests batched. Its prefill runs as a graphed extend (graphed_extend.py, its input
the prompt's thinker rows projected) where the prompt fits a bucket, with the eager prefill's
first logits and KV within float rounding, and as transformers' forward where it does not. The
recorded form runs on a GPU: tests/gpu/test_graphed_talker_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from omni_common.models.base import StageState
from omni_common.models.generation import GenerationState
from omni_common.models.graphed_extend import EXTEND_BUCKETS
from omni_common.models.qwen_omni.talker import Talker
from omni_common.models.qwen_omni.thinker import Thinker
from tests.unit.models.qwen_omni.test_runners import PROMPT, request, run_role

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def thinker(omni_model: Path) -> Iterator[Thinker]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Thinker.load(omni_model, CPU, torch.float32)
    torch.set_num_threads(threads)


def codes(talker: Talker, thinking: list[list[StageState]], sample: int, seeds: list[int]) -> list[list[int]]:
    chunks = run_role(talker, [request(seed=s, talker_do_sample=sample) for s in seeds], thinking)
    assert not talker.slots.active
    return [torch.cat([c.tensors["codes"] for c in out]).tolist() for out in chunks]


@pytest.mark.parametrize("sample", [0, 1])
def test_the_graphed_talker_picks_the_eager_codes_alone_and_batched(
    thinker: Thinker, omni_model: Path, sample: int
) -> None:
    seeds = [1, 2, 3]
    prompts = [PROMPT, "Hi!", "Sing."]
    thinking = [
        run_role(thinker, [request(seed=s, prompt=p)], [[]])[0] for s, p in zip(seeds, prompts, strict=True)
    ]
    eager = Talker.load(omni_model, CPU, torch.float32, decode="eager")
    graphed = Talker.load(omni_model, CPU, torch.float32, decode="graphs")
    assert eager.graphed is None and graphed.graphed is not None
    expected = codes(eager, thinking, sample, seeds)
    assert sum(len(c) for c in expected) > 30
    assert codes(graphed, thinking, sample, seeds) == expected  # batched
    for i, seed in enumerate(seeds):  # and alone
        assert codes(graphed, [thinking[i]], sample, [seed]) == [expected[i]]


def test_a_recordings_warm_ups_leave_the_live_rows_as_they_were(omni_model: Path) -> None:
    """A step is recorded after two warm-up steps (they compile its shape); one can come while
    requests are live, so the warm-ups put back every row's next code, length, step count and
    seen codes (the repetition penalty's): their picks are nobody's."""
    talker = Talker.load(omni_model, CPU, torch.float32, max_slots=2, decode="graphs")
    decode = talker.graphed
    assert decode is not None
    for slot in (0, 1):
        generator = torch.Generator().manual_seed(slot)
        decode.join(slot, torch.tensor([5 + slot]), 3, None, generator, seen=torch.tensor([1, 2]))
    decode.active[:2] = 1
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.05)])
    live = [t.clone() for t in (decode.next_ids, decode.lengths, decode.steps, decode.seen_mask())]
    decode._warm_up(2, processors, do_sample=True)
    after = (decode.next_ids, decode.lengths, decode.steps, decode.seen_mask())
    assert all(torch.equal(a, b) for a, b in zip(after, live, strict=True))
    decode._step(2, processors, True, decode.generators[:2])  # a real step moves all four
    assert not any(torch.equal(a, b) for a, b in zip(after, live, strict=True))


def test_the_default_sampling_is_expected_from_load(omni_model: Path) -> None:
    """Idle time records the default request's graphed steps before any reply: the talker
    expects its sampling setting from load (recording one holds the step loop for up to a minute
    at real size)."""
    talker = Talker.load(omni_model, CPU, torch.float32, max_slots=2, decode="graphs")
    sampling = talker._sampling(request(seed=5), torch.tensor([[1, 2, 3]]), 40)
    assert sampling.graph_key is not None
    assert list(talker.warm_samplings) == [sampling.graph_key]


TOL = 1e-5  # float32, another attention call (a masked SDPA over the slot's row)


def prefilled(talker: Talker, thinking: list[StageState]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The first code's logits and the slot's keys after the prefill of `thinking`'s first chunk."""
    logits: list[torch.Tensor] = []
    pick = talker.pick

    def recording(states: Sequence[GenerationState], found: torch.Tensor) -> None:
        logits.append(found.reshape(-1, found.shape[-1])[-1].clone())
        pick(states, found)

    talker.pick = recording  # type: ignore[method-assign,assignment]
    try:
        state = talker.prepare(request(seed=1, talker_do_sample=0), thinking[0])
    finally:
        del talker.pick  # the class's again
    keys, _ = talker.slots.read(state.slot)
    talker.release(state)
    return logits[0], keys


@pytest.mark.parametrize("words", [4, 300])
def test_the_graphed_talkers_prefill_is_one_extend_where_the_prompt_fits_a_bucket(
    thinker: Thinker, omni_model: Path, words: int
) -> None:
    prompt = " ".join(["boats"] * words)
    thinking = run_role(thinker, [request(seed=1, prompt=prompt)], [[]])[0]
    rows = thinking[0].tensors["prompt"].shape[0] + 2  # the prompt's rows, text-bos, first reply
    eager = Talker.load(omni_model, CPU, torch.float32, max_slots=2, decode="eager")
    graphed = Talker.load(omni_model, CPU, torch.float32, max_slots=2, decode="graphs")
    assert graphed.extend is not None and eager.extend is None
    fits = rows <= EXTEND_BUCKETS[-1]
    assert fits == (words == 4)
    runs = graphed.extend.runs
    logits, keys = prefilled(graphed, thinking)
    assert graphed.extend.runs == runs + int(fits)
    expected_logits, expected_keys = prefilled(eager, thinking)
    assert float((logits - expected_logits).abs().max()) < TOL
    assert max(float((a - b).abs().max()) for a, b in zip(keys, expected_keys, strict=True)) < TOL
