"""The talker's graphed decode recorded on a GPU (tiny Qwen2.5-Omni, float32): fed the thinker's
chunks, it picks the eager talker's codes, greedy and sampled, three requests batched, and
records a step once per bucket and sampling setting, never per request; its prefills run
eagerly until idle work has recorded the extends, then as recorded extends (one a request),
recorded once per bucket."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.qwen_omni.talker import Talker
from omni_common.models.qwen_omni.thinker import Thinker
from tests.unit.models.qwen_omni.test_graphed_talker import codes
from tests.unit.models.qwen_omni.test_runners import PROMPT, request, run_role

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("sample", [0, 1])
def test_the_recorded_talker_picks_the_eager_codes(omni_model: Path, sample: int) -> None:
    thinker = Thinker.load(omni_model, CUDA, torch.float32, decode="eager")
    seeds, prompts = [1, 2, 3], [PROMPT, "Hi!", "Sing."]
    thinking = [
        run_role(thinker, [request(seed=s, prompt=p)], [[]])[0] for s, p in zip(seeds, prompts, strict=True)
    ]
    eager = Talker.load(omni_model, CUDA, torch.float32, max_slots=4, decode="eager")
    graphed = Talker.load(omni_model, CUDA, torch.float32, max_slots=4, decode="graphs")
    assert graphed.graphed is not None
    expected = codes(eager, thinking, sample, seeds)
    extend = graphed.extend
    assert extend is not None and extend.unrecorded()
    first = codes(graphed, thinking, sample, seeds[:1])  # before idle work: the eager prefill
    assert extend.runs == 0 and first == expected[:1]
    while graphed.idle_work():  # the decode's buckets and the extend's
        pass
    assert not extend.unrecorded()
    assert codes(graphed, thinking, sample, seeds) == expected
    recorded = graphed.graphed.captures
    assert 0 < recorded == len(graphed.graphed.graphs)
    extends = dict(extend.graphs)
    assert extends and not extend.failed and extend.runs == len(seeds)
    assert codes(graphed, thinking, sample, seeds) == expected
    assert graphed.graphed.captures == recorded  # none per request
    assert extend.graphs == extends and extend.runs == 2 * len(seeds)
