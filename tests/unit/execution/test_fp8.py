"""FP8 linear layers (omni_common/execution/fp8.py) on the CPU: what they compute against the
layer they replace, and where they refuse to run.

The bound: e4m3 keeps 3 mantissa bits, so quantising rounds each element by at most 2^-4 of
itself (uniform: 2^-4/sqrt(3) RMS); with both operands rounded a product's relative RMS error is
about 0.05 (measured here: 0.034-0.037 with a bias). A layer is asserted within 2^-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from omni_common.execution.fp8 import FP8, Float8Linear, float8_unsupported, quantize_rows, to_float8

ROUNDING = 2**-4  # e4m3's largest relative rounding of one element


def relative_rms(x: torch.Tensor, reference: torch.Tensor) -> float:
    x, reference = x.float(), reference.float()
    return float((x - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())


@pytest.mark.parametrize(("k", "n"), [(48, 48), (256, 1024)])
def test_an_fp8_layer_computes_the_linear_layer_within_e4m3_rounding(k: int, n: int) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n)
    x = torch.randn(3, 20, k)  # any leading dimensions
    with torch.no_grad():
        expected = linear(x)
    fp8 = to_float8(copy.deepcopy(linear))
    assert type(fp8) is Float8Linear and fp8.weight.dtype == FP8
    assert fp8.weight_scale.shape == (1, n) and fp8.weight_scale.dtype == torch.float32
    assert torch.equal(fp8.bias, linear.bias)
    with torch.no_grad():
        out = fp8(x)
    assert out.shape == expected.shape and out.dtype == x.dtype
    error = relative_rms(out, expected)
    assert 0 < error <= ROUNDING, error


def test_the_output_keeps_the_inputs_dtype_and_a_zero_row_stays_zero() -> None:
    torch.manual_seed(0)
    fp8 = to_float8(torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    x[1] = 0
    with torch.no_grad():
        out = fp8(x)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all() and not out[1].any()


def test_quantized_rows_map_each_rows_largest_magnitude_to_the_fp8_maximum() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -1000.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (3, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.tensor([448.0, 0.0, 448.0]))
    assert torch.allclose(q.float() * scale, x, rtol=ROUNDING, atol=0)


def test_conversion_is_idempotent_and_takes_only_plain_linear_layers() -> None:
    fp8 = to_float8(torch.nn.Linear(16, 16))
    weight = fp8.weight
    assert to_float8(fp8) is fp8 and fp8.weight is weight
    with pytest.raises(ValueError, match=r"nn\.Linear layers, not Bilinear"):
        to_float8(torch.nn.Bilinear(4, 4, 4))  # type: ignore[arg-type]


def test_a_traced_fp8_layer_is_one_graph_that_computes_as_eager() -> None:
    """fullgraph: the quantisation is plain torch ops the compiler can fuse (inductor's own
    kernels are checked on a GPU: tests/gpu/test_fp8_gpu.py)."""
    torch.manual_seed(0)
    fp8 = to_float8(torch.nn.Linear(64, 32))
    x = torch.randn(8, 64)
    traced = torch.compile(fp8, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(traced(x), fp8(x))


def test_devices_without_fp8_products_are_named_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert float8_unsupported(torch.device("cpu")) == ""  # torch 2.13's CPU has row-wise _scaled_mm
    assert "not available on meta devices" in float8_unsupported(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert float8_unsupported(torch.device("cuda:0")) == (
        "NVIDIA A100 (compute capability 8.0) has no FP8 products; they need 8.9 or newer"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8_unsupported(torch.device("cuda:0")) == ""
