"""--quantization fp8 on a GPU (compute capability 8.9+: H100, L40, RTX 4090), on the tiny
fixture in bf16: the FP8 layer's product is cuBLASLt's row-wise scaled one, the stage's
compiled blocks and CUDA graphs run the FP8 layers, and the latents stay within FP8 rounding of
the bf16 ones (the CPU tests' bound, tests/unit/models/qwenimage/test_fp8.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.execution.fp8 import Float8Linear, float8_unsupported, to_float8
from omni_common.models.base import DenoiserOptions, GenerationRequest, StageState
from omni_common.models.qwenimage.denoise import QwenImageDenoiser

DEVICE = torch.device("cuda", 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and bool(float8_unsupported(DEVICE)), reason="needs FP8 products (8.9+)"
    ),
]
ROUNDING = 2**-4  # e4m3's largest relative rounding of one element


def relative_rms(x: torch.Tensor, reference: torch.Tensor) -> float:
    x, reference = x.float(), reference.float()
    return float((x - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())


def test_an_fp8_layer_on_the_gpu_matches_the_bf16_layer_eager_and_compiled() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3072, 3072).to(DEVICE, torch.bfloat16)
    x = torch.randn((2, 1024, 3072), device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x)
        fp8 = to_float8(linear)
        eager = fp8(x)
        compiled = torch.compile(fp8, fullgraph=True)(x)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    assert relative_rms(eager, expected) <= ROUNDING
    assert relative_rms(compiled, expected) <= ROUNDING
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)  # fused quantisation, same math


def latents(model: Path, options: DenoiserOptions) -> torch.Tensor:
    denoiser = QwenImageDenoiser.load(model, DEVICE, torch.bfloat16, options)
    assert any(isinstance(m, Float8Linear) for m in denoiser.transformer.modules()) == (
        options.quantization == "fp8"
    )
    generator = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 7, 16, generator=generator).to(torch.bfloat16)
    request = GenerationRequest(prompt="p", width=64, height=64, num_inference_steps=8, seed=1)
    with torch.inference_mode():
        state = denoiser.prepare(request, StageState({"prompt_embeds": embeds}))
        while not denoiser.is_done(state):
            denoiser.step([state])
    return state.latents


@pytest.mark.parametrize(
    "execution",
    [{}, {"compile": True}, {"compile": True, "cuda_graphs": True, "capture_sizes": ((64, 64),)}],
    ids=["eager", "compiled", "compiled+graphs"],
)
def test_the_fp8_stage_runs_eager_compiled_and_graphed(
    tiny_model: Path, execution: dict[str, object]
) -> None:
    torch._dynamo.reset()
    options = DenoiserOptions(max_batch=2, **execution)  # type: ignore[arg-type]
    expected = latents(tiny_model, options)
    got = latents(tiny_model, DenoiserOptions(max_batch=2, quantization="fp8", **execution))  # type: ignore[arg-type]
    error = relative_rms(got, expected)
    print(f"fp8 against bf16 ({execution}): relative RMS {error:.3g}")
    assert torch.isfinite(got).all() and error <= ROUNDING
