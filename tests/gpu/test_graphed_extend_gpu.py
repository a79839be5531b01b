"""The thinker's graphed extends recorded on a GPU (tiny Qwen2.5-Omni, float32): a short text
prompt and a conversation's turn after a reused prefix with a clip pick the eager prefill's
tokens, with its talker rows within float rounding; a forward is recorded once per bucket,
ahead by idle work, never per request. Both attentions of the extend: the padded SDPA (the
fixture's 8-channel heads) and FlexAttention over the row's blocks (the same fixture with
16-channel heads, the narrowest flex's kernels take, 3 a KV head: no power of two, as the
real 7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.graphed_extend import EXTEND_BUCKETS
from omni_common.models.qwen_omni.fixture import build_tiny_fixture
from omni_common.models.qwen_omni.thinker import Thinker
from tests.unit.models.qwen_omni.test_graphed_extend import FIRST, SECOND, Reply
from tests.unit.models.qwen_omni.test_graphed_extend import request as chat_request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def omni_model_wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "qwen-omni-16", flex_heads=True)


ATTENTIONS = [("omni_model", "padded"), ("omni_model_wide_heads", "flex")]


@pytest.mark.parametrize(("model", "attention"), ATTENTIONS)
def test_recorded_extends_pick_the_eager_tokens_and_record_once_per_bucket(
    model: str, attention: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(model)
    load = {"max_slots": 2, "max_tokens": 1024}
    eager = Thinker.load(model_dir, CUDA, torch.float32, decode="eager", **load)  # type: ignore[arg-type]
    graphed = Thinker.load(model_dir, CUDA, torch.float32, decode="graphs", **load)  # type: ignore[arg-type]
    extend = graphed.extend
    assert extend is not None and extend.unrecorded() == list(EXTEND_BUCKETS)
    assert extend.decode.attention == attention
    while graphed.idle_work():  # the decode's buckets and the extend's, ahead of any request
        pass
    assert graphed.idle_work_left() == 0 and sorted(extend.graphs) == list(EXTEND_BUCKETS)
    assert not extend.failed
    recorded = dict(extend.graphs)
    short = chat_request("Tell me a short story.")
    Reply(graphed, short).assert_like(Reply(eager, short))
    for thinker in (eager, graphed):
        Reply(thinker, chat_request(turns=FIRST))
    runs = extend.runs
    Reply(graphed, chat_request(turns=SECOND)).assert_like(Reply(eager, chat_request(turns=SECOND)))
    assert extend.runs == runs + 1
    assert extend.graphs == recorded  # the same graphs: none recorded for a request
