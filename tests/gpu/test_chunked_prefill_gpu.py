"""Chunked prefill under the recorded graphed decode (tiny Qwen2.5-Omni thinker on a GPU,
float32): a long prompt that joins a running reply, prefilled a chunk per step, picks the
tokens of the eager decode with whole prefills, and its chunks record no graph of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.qwen_omni.thinker import Thinker
from tests.unit.models.qwen_omni.test_chunked_prefill import CHUNK, joined_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

CUDA = torch.device("cuda", 0)


def test_a_prompt_joining_in_chunks_picks_the_eager_tokens_and_records_per_bucket(omni_model: Path) -> None:
    eager = Thinker.load(omni_model, CUDA, torch.float32, max_slots=2, decode="eager", prefix_bytes=0)
    graphed = Thinker.load(
        omni_model,
        CUDA,
        torch.float32,
        max_slots=2,
        decode="graphs",
        prefix_bytes=0,
        prefill_chunk_tokens=CHUNK,
    )
    assert graphed.graphed is not None
    expected = joined_run(eager)
    assert joined_run(graphed) == expected
    recorded = graphed.graphed.captures
    assert recorded == len(graphed.graphed.graphs) <= 2  # buckets 1 and 2
    assert joined_run(graphed) == expected and graphed.graphed.captures == recorded
    assert graphed.prefill_chunks() > 0 and not graphed.slots.active
