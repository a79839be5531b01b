"""Chunked prefill through real gRPC servers (tiny Qwen2.5-Omni, CPU fp32): with
--prefill-chunk-tokens 16, a long prompt's spoken reply says transformers' `generate` text and
codes, its waveform within float rounding of `generate`'s (the chunks' talker rows differ from
one whole prefill's by <= 3.6e-7: tests/unit/models/qwen_omni/test_chunked_prefill.py), and the
encoder's metrics count the chunks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omni_common.client import Client
from omni_common.cluster import free_port
from omni_common.models.qwen_omni.reference import reference_generate
from tests.integration.conftest import InProcessCluster

LONG = " ".join(f"Sentence {i} of a long prompt about boats, rivers and the sea." for i in range(4))
CAPS = {"max_new_tokens": 12, "talker_max_new_tokens": 40}


@pytest.fixture(scope="module")
def chunked(omni_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(
        omni_model, stage_options={"ar-encoder": {"prefill_chunk_tokens": 16, "metrics_port": free_port()}}
    )
    running.start()
    yield running
    running.stop()


def test_a_long_prompt_prefilled_in_chunks_says_the_reference_reply(
    chunked: InProcessCluster, omni_model: Path
) -> None:
    with Client(chunked.coordinator) as client:
        reply = client.speak(LONG, seed=3, stream_audio=False, options=CAPS)
    ref = reference_generate(omni_model, LONG, seed=3, thinker_max_new_tokens=12, talker_max_new_tokens=40)
    assert reply.text == ref.text
    difference = float(np.abs(reply.audio - ref.waveform.numpy()).max()) if len(reply.audio) else 0.0
    print(f"chunked reply vs generate: {len(reply.audio)} samples, max |difference| {difference:.3g}")
    # Measured: 0 over 19,200 samples; the bound allows what float rounding of the rows could move.
    np.testing.assert_allclose(reply.audio, ref.waveform.numpy(), rtol=0, atol=1e-4)
    labels = frozenset({"stage": "ar-encoder", "role": "thinker"}.items())
    assert chunked.metrics("ar-encoder")[("omnistage_prefill_chunks_total", labels)] >= 3
