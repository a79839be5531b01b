"""The image stream's feed-forward GELU in its GEMM's epilogue (epilogue.py) on a GPU: the
compiled layer calls cuBLASLt's fused product and agrees with diffusers' eager layer to
float rounding (one rounding to bf16 where diffusers has two)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.activations import GELU

from omni_common.models.qwenimage.epilogue import EpilogueGELU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuBLASLt's epilogue)"),
]

DEVICE = torch.device("cuda", 0)


def test_the_compiled_layer_fuses_the_gelu_and_matches_eager() -> None:
    torch.manual_seed(0)
    layer = GELU(256, 1024, approximate="tanh").to(DEVICE, torch.bfloat16)
    x = torch.randn((2, 77, 256), device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = layer(x)
        layer.__class__ = EpilogueGELU
        assert torch.equal(layer(x), expected)  # eager: diffusers' own
        targets = []

        def recording(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
            targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward

        torch.compile(layer, fullgraph=True, backend=recording)(x)
        assert torch._addmm_activation in targets
        got = torch.compile(layer, fullgraph=True)(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # One bf16 rounding of the biased product fewer: at most an ulp of the output apart.
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=1e-2)
