"""The Qwen-Image text encoder with compiled decoder layers (the ar-encoder's `--compile` on a
GPU) on the tiny fixture: its embeddings equal the eager encoder's up to float rounding, and
after its warm-up new prompt lengths and batch sizes compile nothing new."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.qwenimage.encode import QwenImageEncoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled on CUDA only)"),
]

DEVICE = torch.device("cuda", 0)
PROMPTS = ["a red fox", "the number seven written twice, small, in the corner", "x"]


def embeddings(encoder: QwenImageEncoder, texts: list[str]) -> list[torch.Tensor]:
    return encoder.embed_texts(texts, alone=False)


def test_compiled_layers_give_the_eager_embeddings_and_compile_once(tiny_model: Path) -> None:
    from torch._dynamo.utils import counters

    eager = QwenImageEncoder.load(tiny_model, DEVICE, torch.float32)
    expected = [embeddings(eager, [text]) for text in PROMPTS] + [embeddings(eager, PROMPTS)]
    compiled = QwenImageEncoder.load(tiny_model, DEVICE, torch.float32)
    compiled.compile()
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    got = [embeddings(compiled, [text]) for text in PROMPTS] + [embeddings(compiled, PROMPTS)]
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up
    for want_texts, got_texts in zip(expected, got, strict=True):
        for want, have in zip(want_texts, got_texts, strict=True):
            torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
