"""Qwen-Image's rotary position embedding in real arithmetic, for the compiled forward.

diffusers (0.42) applies it as a complex multiplication, for which inductor generates no
code: each of its four calls a block (image and text queries and keys) stays a PyTorch
kernel of its own, 240 of them a forward (4.0 ms of a 1024x1024 step on an H200, 7.5 ms of a
step of 8 at 512x512: benchmarks/dit_profile.py). The same products written on the cosine
and sine fuse into the kernels around them. The math is the complex product's, term by term:
equal to diffusers' on the CPU (tests/unit/models/qwenimage/test_rotary.py). Only traced code
takes it: an eager forward in the same process stays diffusers' own.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers import transformer_qwenimage

_diffusers_rotary = transformer_qwenimage.apply_rotary_emb_qwen


def apply_rotary_real(
    x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1
) -> torch.Tensor:
    """diffusers' apply_rotary_emb_qwen; while torch.compile traces, its complex form
    (use_real=False) on real numbers. Eager calls stay diffusers' own, bit for bit on every
    device (on a GPU the complex kernel rounds its products differently)."""
    complex_form = not use_real and isinstance(freqs_cis, torch.Tensor) and freqs_cis.is_complex()
    if not complex_form or not torch.compiler.is_compiling():
        return _diffusers_rotary(x, freqs_cis, use_real, use_real_unbind_dim)  # type: ignore[return-value]
    return rotate_real(x, freqs_cis)


def rotate_real(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] as D/2 pairs (real, imaginary) times complex freqs_cis [S, D/2].

    Written as x * cos + swap(x) * sin, swap(real, imag) = (-imag, real): each output reads
    its own element and its pair's, which inductor fuses into the query and key RMSNorm before
    it as index arithmetic. Stacking the two products instead made that fused kernel slower:
    47 against 38 us a call at 1024x1024, 108 against 79 us for 8 at 512x512 (an H200,
    docs/benchmarks.md)."""
    freqs = torch.view_as_real(freqs_cis).unsqueeze(1)  # [S, 1, D/2, 2]: (cos, sin)
    cos, sin = freqs[..., :1], freqs[..., 1:]
    pairs = x.float().unflatten(-1, (-1, 2))
    sign = torch.tensor((-1.0, 1.0), device=x.device)
    rotated = pairs * cos + pairs.flip(-1) * sign * sin
    return rotated.flatten(3).type_as(x)


def use_real_rotary() -> None:
    """Make every compiled Qwen-Image attention of this process rotate in real arithmetic
    (idempotent; eager ones are unchanged)."""
    transformer_qwenimage.apply_rotary_emb_qwen = apply_rotary_real  # type: ignore[assignment]
