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


def test_lone_prompts_replay_graphs_with_the_eager_embeddings(tiny_model: Path) -> None:
    """The ar-encoder's `--cuda-graphs` on a GPU: a lone prompt replays its length bucket's
    graph (padded at its end) and gets the eager embeddings up to float rounding; prompts
    encoded together and prompts beyond GRAPHED_TOKENS run eagerly; after the weights move
    (forget_cuda_graphs) the graphs are captured again."""
    from omni_common.models.qwenimage.encode import GRAPHED_TOKENS, WARM_GRAPH_TOKENS, template_tokens

    eager = QwenImageEncoder.load(tiny_model, DEVICE, torch.float32)
    long_prompt = " ".join(["word"] * GRAPHED_TOKENS)
    texts = [*PROMPTS, long_prompt]
    expected = [embeddings(eager, [text])[0] for text in texts]
    graphed = QwenImageEncoder.load(tiny_model, DEVICE, torch.float32)
    graphed.use_cuda_graphs()
    assert graphed.graphs is not None and len(graphed.graphs) == len(WARM_GRAPH_TOKENS)
    for text, want in zip(texts, expected, strict=True):
        torch.testing.assert_close(embeddings(graphed, [text])[0], want, atol=1e-4, rtol=1e-4)

    def graph_of(text: str) -> torch.Tensor | None:
        tokens = template_tokens(eager.tokenizer, [text], return_tensors="pt").input_ids.to(DEVICE)
        return graphed._graphed(tokens)

    assert all(graph_of(text) is not None for text in PROMPTS) and graph_of(long_prompt) is None
    for want, got in zip(embeddings(eager, PROMPTS), embeddings(graphed, PROMPTS), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    graphed.forget_cuda_graphs()
    assert len(graphed.graphs) == 0
    torch.testing.assert_close(embeddings(graphed, [PROMPTS[0]])[0], expected[0], atol=1e-4, rtol=1e-4)
    assert len(graphed.graphs) == 1
