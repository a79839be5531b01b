"""The compiled forward's rotary embedding in real arithmetic (rotary.py) against diffusers'
complex one: the same numbers on the CPU, and the same forward of the tiny transformer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage

from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.rotary import apply_rotary_real, rotate_real

from ..conftest import CPU
from .test_graphs import inputs

DIFFUSERS_ROTARY = transformer_qwenimage.apply_rotary_emb_qwen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_rotary_equals_the_complex_product(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((2, 37, 3, 16), generator=generator).to(dtype)
    freqs = torch.polar(torch.ones(37, 8), torch.randn((37, 8), generator=generator) * 3)
    expected = DIFFUSERS_ROTARY(x, freqs, use_real=False)
    got = rotate_real(x, freqs)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert not torch.equal(got, x)  # it rotates
    compiled = torch.compile(apply_rotary_real, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, freqs, use_real=False), expected)  # traced: the real form


def test_eager_calls_stay_diffusers_own(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr("omni_common.models.qwenimage.rotary.rotate_real", lambda *a: calls.append(a))
    x, freqs = torch.randn((1, 3, 2, 4)), torch.polar(torch.ones(3, 2), torch.randn((3, 2)))
    assert torch.equal(
        apply_rotary_real(x, freqs, use_real=False), DIFFUSERS_ROTARY(x, freqs, use_real=False)
    )
    assert not calls


def test_the_real_form_of_cos_and_sin_is_still_diffusers_own() -> None:
    x = torch.randn((1, 2, 5, 8))
    cos, sin = torch.randn((5, 8)), torch.randn((5, 8))
    assert torch.equal(apply_rotary_real(x, (cos, sin)), DIFFUSERS_ROTARY(x, (cos, sin)))


def test_a_transformer_forward_rotating_in_real_arithmetic_is_unchanged(
    tiny_model: Path, monkeypatch
) -> None:
    denoiser = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
    plain, img_shapes = inputs(denoiser, 3, [5, 11, 7])
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    monkeypatch.setattr(transformer_qwenimage, "apply_rotary_emb_qwen", apply_rotary_real)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as when traced
    assert torch.equal(transformer_forward(denoiser.transformer, plain, img_shapes), expected)
