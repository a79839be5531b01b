"""FP8 linear layers: float8_e4m3fn matrix products with one dynamic scale per activation row
(token) and one fixed scale per weight row (output channel), through `torch._scaled_mm`.

The weights are quantised once, when a layer is converted; each forward quantises its input rows
with plain torch ops (amax over the row, divide, clamp, cast), which torch.compile fuses into the
kernel that produces those rows (the norm and modulation before an attention projection, the
GELU before a feed-forward's second layer), so the quantisation costs no pass over memory of its
own. Unfused, it does: a `torch._scaled_mm` with a separate quantisation kernel was slower than
bf16 on a 3072-wide layer of an H100 (issue 35). The bias is added after the product, where the
compiler fuses it into the next pointwise kernel too.

Why not torchao's Float8 training/inference linears: torchao 0.18 refuses any device below CUDA
compute capability 8.9, the CPU included ("requires CUDA compute capability >= 8.9"), so no CI
machine could run a test of the path that serves. `torch._scaled_mm` takes row-wise scales on
the CPU as on an H100 (torch 2.11+), so this one runs in the CPU tests and on the GPU alike.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The smallest amax a row is scaled by: a row of zeros then quantises to zeros, not NaN.
MIN_AMAX = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [rows, k] as float8_e4m3fn and its float32 scales [rows, 1]: x ~= q * scale, each row's
    largest magnitude mapped to FP8_MAX."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Float8Linear(nn.Linear):
    """An nn.Linear whose weight is float8_e4m3fn [out, in] with per-output-channel scales
    `weight_scale` [1, out] (float32), computing in FP8 with per-row activation scales; the
    output keeps the input's dtype. Made by `to_float8` from a loaded layer: its name, bias and
    hooks stay (LoRA adapters hook it as any linear layer)."""

    weight_scale: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        q, scale = quantize_rows(rows)
        # weight.t() is the column-major [in, out] operand _scaled_mm wants, with no copy.
        out = torch._scaled_mm(
            q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype
        )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


@torch.no_grad()
def to_float8(linear: nn.Linear) -> Float8Linear:
    """Quantise `linear` in place to a Float8Linear (idempotent): its weight becomes FP8 with one
    scale per output channel; the bias keeps its dtype."""
    if isinstance(linear, Float8Linear):
        return linear
    if type(linear) is not nn.Linear:
        raise ValueError(f"to_float8 converts nn.Linear layers, not {type(linear).__name__}")
    q, scale = quantize_rows(linear.weight)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.__class__ = Float8Linear
    # Not in the state dict: weight pushes name the model's weights, and refuse FP8 ones.
    linear.register_buffer("weight_scale", scale.t().contiguous(), persistent=False)
    return linear  # type: ignore[return-value]


def float8_unsupported(device: torch.device) -> str:
    """Why FP8 products cannot run on `device`; "" when they can."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return f"{name} (compute capability {major}.{minor}) has no FP8 products; they need 8.9 or newer"
        return ""
    if device.type == "cpu":
        return "" if _cpu_scaled_mm() else f"PyTorch {torch.__version__} has no FP8 products on the CPU"
    return f"FP8 products are not available on {device.type} devices"


@functools.cache
def _cpu_scaled_mm() -> bool:
    """Whether this build runs a row-wise scaled FP8 product on the CPU (tried once, tiny)."""
    a, scale = torch.ones((16, 16)).to(FP8), torch.ones((16, 1))
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True
