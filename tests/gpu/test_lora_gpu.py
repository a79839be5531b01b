"""LoRA adapters and weight pushes beside CUDA graphs and compiled blocks on the tiny fixture
(skipped without CUDA).

A step with adapters must not replay a graph captured without them (it runs eagerly, compiled
blocks bypassed), a step without adapters keeps replaying its graph, and a weight push copied in
place is followed by the graphs already captured. fp32; compiled and eager kernels round
differently, so images agree within ATOL (measured ~1e-6 on the latents)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.base import DenoiserOptions, GenerationRequest
from omni_common.models.lora_files import save_random_lora
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.runtime.hot_reload import copy_weights, planned_copies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

DEVICE = torch.device("cuda", 0)
ATOL = 1e-4


@pytest.fixture(scope="module")
def runners(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """(encoder, compiled + graphed denoiser, eager denoiser, adapter files) on the GPU."""
    options = DenoiserOptions(cuda_graphs=True, compile=True, capture_sizes=((64, 64),), max_batch=4)
    fast = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    eager = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32)
    root = tmp_path_factory.mktemp("loras")
    cpu = QwenImageDenoiser.load(tiny_model, torch.device("cpu"), torch.float32).transformer
    files = {
        name: save_random_lora(root / f"{name}.safetensors", cpu, seed=seed)
        for name, seed in (("a", 1), ("b", 2))
    }
    return QwenImageEncoder.load(tiny_model, DEVICE, torch.float32), fast, eager, files


def latents(encoder, denoiser, requests: list[GenerationRequest]) -> list[torch.Tensor]:
    states = [denoiser.prepare(r, e) for r, e in zip(requests, encoder.encode(requests), strict=True)]
    while not all(denoiser.is_done(s) for s in states):
        denoiser.step([s for s in states if not denoiser.is_done(s)])
    return [denoiser.finish(s).tensors["latents"] for s in states]


def request(seed: int, loras: tuple[tuple[str, float | None], ...] = ()) -> GenerationRequest:
    return GenerationRequest(
        prompt="a cat", width=64, height=64, num_inference_steps=4, true_cfg_scale=1.0, seed=seed, loras=loras
    )


def test_adapters_run_eagerly_beside_graphs_and_plain_steps_keep_replaying(runners) -> None:
    encoder, fast, eager, files = runners
    [plain_before] = latents(encoder, fast, [request(1)])
    graphs = len(fast.graphed.cache)
    for denoiser in (fast, eager):
        denoiser.loras.add("a", files["a"])
        denoiser.loras.add("b", files["b"])
    [plain_after] = latents(encoder, fast, [request(1)])
    assert torch.equal(plain_after, plain_before)  # the same graph replayed, hooks idle
    # On a GPU rows with adapters batch apart from rows without (those keep their graphs).
    mixed = [request(2, (("a", 0.8),)), request(3, (("b", 1.2), ("a", -0.4)))]
    got = latents(encoder, fast, mixed)
    expected = latents(encoder, eager, mixed)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    [without] = latents(encoder, eager, [request(2)])
    assert (got[0] - without).abs().max() > 1e-3  # the adapter was applied, not replayed away
    assert len(fast.graphed.cache) == graphs  # nothing captured with adapters


def test_a_weight_push_is_followed_by_the_captured_graphs(runners) -> None:
    encoder, fast, eager, _ = runners
    latents(encoder, fast, [request(5)])  # captured
    generator = torch.Generator().manual_seed(9)
    new = {
        name: t.detach().cpu() + 0.02 * torch.randn(t.shape, generator=generator)
        for name, t in eager.transformer.state_dict().items()
        if t.is_floating_point()
    }
    for denoiser in (fast, eager):
        copy_weights(planned_copies([("transformer", denoiser.transformer)], new))
        denoiser.weights_changed()  # as the worker does after LoadWeights (its packed modulation)
    [got] = latents(encoder, fast, [request(5)])
    [expected] = latents(encoder, eager, [request(5)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
