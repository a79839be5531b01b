"""The vLLM encoder backend (skipped without vLLM): on the fixture variant with head_dim 32
(vLLM's CPU attention needs >= 32), in fp32, its prompt embeddings equal the torch backend's
within 1e-5, alone and under concurrency (the engine batches concurrent texts)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.prompt_cache import EmbeddingCache
from omni_common.models.qwenimage.prompt_encoder import PromptEncoder, VllmBackend
from omni_common.models.qwenimage.vllm_encoder import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (OMNISTAGE_VLLM=1 setup)"),
]
TEXTS = ["a red cat sitting on a blue mat", " ", "blurry, low quality, watermark", "a dog"]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_common.models.qwenimage.fixture import build_tiny_fixture

    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "qwen-image-tiny-hd32", head_dim=32)


def test_vllm_embeddings_equal_torch_backend(wide_model: Path) -> None:
    from omni_common.models.qwenimage.vllm_encoder import VllmTextEncoder

    torch_encoder = QwenImageEncoder.load(wide_model, torch.device("cpu"), torch.float32)
    requests = [
        GenerationRequest(prompt=TEXTS[i % 4], negative_prompt=TEXTS[(i + 1) % 4], true_cfg_scale=4.0)
        for i in range(12)
    ]

    async def run() -> None:
        vllm_encoder = VllmTextEncoder(wide_model, torch.float32)
        try:
            alone = await vllm_encoder.embed_texts(TEXTS)
            reference = torch_encoder.embed_texts(TEXTS, alone=True)
            for got, want in zip(alone, reference, strict=True):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert (got - want).abs().max().item() <= 1e-5
            # Concurrent requests through the runner, without the cache.
            runner = PromptEncoder(VllmBackend(vllm_encoder, max_queue=64), EmbeddingCache(0), "m")
            states = await asyncio.gather(*(runner.encode(r) for r in requests))
            for request, state in zip(requests, states, strict=True):
                want_state = torch_encoder.encode([request])[0]
                assert set(state.tensors) == {"prompt_embeds", "negative_prompt_embeds"}
                for name, want_tensor in want_state.tensors.items():
                    assert state.tensors[name].shape == want_tensor.shape
                    assert (state.tensors[name] - want_tensor).abs().max().item() <= 1e-5
        finally:
            vllm_encoder.close()

    asyncio.run(run())
