"""The thinker's graphed extends recorded on a GPU (tiny Qwen2.5-Omni, float32): a short text
prompt and a conversation's turn after a reused prefix with a clip pick the eager prefill's
tokens, with its talker rows within float rounding; a forward is recorded once per bucket,
ahead by idle work, never per request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.graphed_extend import EXTEND_BUCKETS
from omni_common.models.qwen_omni.thinker import Thinker
from tests.unit.models.qwen_omni.test_graphed_extend import FIRST, SECOND, Reply, request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

CUDA = torch.device("cuda", 0)


def test_recorded_extends_pick_the_eager_tokens_and_record_once_per_bucket(omni_model: Path) -> None:
    load = {"max_slots": 2, "max_tokens": 1024}
    eager = Thinker.load(omni_model, CUDA, torch.float32, decode="eager", **load)  # type: ignore[arg-type]
    graphed = Thinker.load(omni_model, CUDA, torch.float32, decode="graphs", **load)  # type: ignore[arg-type]
    extend = graphed.extend
    assert extend is not None and extend.unrecorded() == list(EXTEND_BUCKETS)
    while graphed.idle_work():  # the decode's buckets and the extend's, ahead of any request
        pass
    assert graphed.idle_work_left() == 0 and sorted(extend.graphs) == list(EXTEND_BUCKETS)
    assert not extend.failed
    recorded = dict(extend.graphs)
    short = request("Tell me a short story.")
    Reply(graphed, short).assert_like(Reply(eager, short))
    for thinker in (eager, graphed):
        Reply(thinker, request(turns=FIRST))
    runs = extend.runs
    Reply(graphed, request(turns=SECOND)).assert_like(Reply(eager, request(turns=SECOND)))
    assert extend.runs == runs + 1
    assert extend.graphs == recorded  # the same graphs: none recorded for a request
