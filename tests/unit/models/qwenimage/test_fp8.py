"""Qwen-Image's DiT with --quantization fp8 on the CPU (tiny fixture, fp32 activations): which
layers turn FP8, how far its predictions and latents stay from the model dtype's, and where the
flag is refused.

The bound: every FP8 product rounds its operands to 3 mantissa bits, at most 2^-4 of each
element (tests/unit/execution/test_fp8.py); a block adds its products' outputs to an exact
residual stream, and the Euler steps' weights (the sigma decrements) sum to 1, so neither a
prediction nor the latents after all steps may be off by more than a product is: a relative RMS
of 2^-4. Measured here: 2.8e-3 for one forward, 1.1e-3 for the latents after 8 steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from omni_common.errors import FailedPrecondition, InvalidArgument, Unimplemented
from omni_common.execution.fp8 import FP8, Float8Linear
from omni_common.models.base import DenoiserOptions, GenerationRequest, StageState
from omni_common.models.glm_image.family import GlmImageFamily
from omni_common.models.lora_files import save_random_lora
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.family import QwenImageFamily
from omni_common.models.qwenimage.fp8 import quantize_blocks
from omni_common.runtime.config import StageConfig, add_stage_args, stage_config
from omni_common.runtime.hot_reload import planned_copies
from services.dit_denoise.worker import DenoiseWorker

from ..conftest import CPU
from .test_graphs import inputs

ROUNDING = 2**-4
LINEARS_PER_BLOCK = 12  # q/k/v and out of each stream (8), two feed-forward layers per stream (4)


def relative_rms(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())


def load(model: Path, quantization: str = "none") -> QwenImageDenoiser:
    return QwenImageDenoiser.load(model, CPU, torch.float32, DenoiserOptions(quantization=quantization))


def denoised(
    denoiser: QwenImageDenoiser, cfg: bool, loras: tuple[tuple[str, float | None], ...] = ()
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tensors = {"prompt_embeds": torch.randn(1, 7, 16, generator=generator)}
    if cfg:
        tensors["negative_prompt_embeds"] = torch.randn(1, 4, 16, generator=generator)
    request = GenerationRequest(
        prompt="p",
        negative_prompt="n" if cfg else "",
        width=64,
        height=64,
        num_inference_steps=8,
        seed=1,
        loras=loras,
    )
    state = denoiser.prepare(request, StageState(tensors))
    while not denoiser.is_done(state):
        denoiser.step([state])
    return state.latents


def test_the_blocks_products_turn_fp8_and_the_rest_keeps_the_model_dtype(tiny_model: Path) -> None:
    denoiser = load(tiny_model, "fp8")
    transformer = denoiser.transformer
    fp8 = [name for name, module in transformer.named_modules() if isinstance(module, Float8Linear)]
    assert len(fp8) == LINEARS_PER_BLOCK * len(transformer.transformer_blocks)
    assert all(name.startswith("transformer_blocks.") for name in fp8)
    assert not any(".img_mod." in name or ".txt_mod." in name for name in fp8)
    kept = [
        transformer.proj_out,
        transformer.img_in,
        transformer.txt_in,
        *(block.img_mod[1] for block in transformer.transformer_blocks),
    ]
    assert all(type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32 for layer in kept)
    assert all(transformer.get_submodule(name).weight.dtype == FP8 for name in fp8)
    assert quantize_blocks(transformer, CPU) == len(fp8)  # idempotent


def test_an_fp8_forward_stays_within_fp8_rounding_of_the_model_dtype(tiny_model: Path) -> None:
    plain, fp8 = load(tiny_model), load(tiny_model, "fp8")
    batch, img_shapes = inputs(plain, 2, [5, 9])
    with torch.inference_mode():
        expected = transformer_forward(plain.transformer, batch, img_shapes)
        got = transformer_forward(fp8.transformer, batch, img_shapes)
    error = relative_rms(got, expected)
    print(f"one forward, fp8 against fp32: relative RMS {error:.3g}")
    assert 0 < error <= ROUNDING


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_fp8_latents_after_every_step_stay_within_fp8_rounding(tiny_model: Path, cfg: bool) -> None:
    expected = denoised(load(tiny_model), cfg)
    got = denoised(load(tiny_model, "fp8"), cfg)
    error = relative_rms(got, expected)
    print(f"latents after 8 steps (cfg={cfg}), fp8 against fp32: relative RMS {error:.3g}")
    assert torch.isfinite(got).all()
    assert 0 < error <= ROUNDING


def test_fp8_is_refused_where_it_cannot_run(tiny_model: Path) -> None:
    denoiser = load(tiny_model)
    with pytest.raises(FailedPrecondition, match=r"--quantization fp8 cannot run here: .*meta devices"):
        quantize_blocks(denoiser.transformer, torch.device("meta"))
    with pytest.raises(InvalidArgument, match="quantization 'int4' is not offered for Qwen-Image"):
        denoiser.configure(DenoiserOptions(quantization="int4"))
    assert not any(isinstance(m, Float8Linear) for m in denoiser.transformer.modules())


def test_a_family_without_fp8_is_refused_at_start(glm_model: Path) -> None:
    with pytest.raises(Unimplemented, match="glm-image offers no --quantization fp8"):
        GlmImageFamily().card.check_quantization("glm-image", "fp8")
    config = StageConfig(stage="dit-denoise", model_dir=glm_model, device="cpu", quantization="fp8")
    refusal = r"dit-denoise: glm-image offers no --quantization fp8 \(offered: none\)"
    with pytest.raises(SystemExit, match=refusal):
        DenoiseWorker(config)
    qwen_image = QwenImageFamily()  # bf16 is a float32 DiT's mode (Qwen2.5-Omni's token2wav)
    with pytest.raises(Unimplemented, match=r"qwenimage offers no --quantization bf16 \(offered: fp8\)"):
        qwen_image.card.check_quantization(qwen_image.name, "bf16")


def test_the_flag_reaches_the_denoiser(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNISTAGE_QUANTIZATION", "fp8")  # the environment fallback
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "dit-denoise")
    args = parser.parse_args(["--model", str(tiny_model), "--device", "cpu"])
    worker = DenoiseWorker(stage_config("dit-denoise", args))
    try:
        assert worker.denoiser_options().quantization == "fp8"
        block = worker.model.transformer.transformer_blocks[0]  # type: ignore[attr-defined]
        assert isinstance(block.attn.to_q, Float8Linear)
    finally:
        worker.close()


def test_weight_pushes_to_fp8_layers_are_refused_and_the_rest_still_load(tiny_model: Path) -> None:
    denoiser = load(tiny_model, "fp8")
    modules = [("transformer", denoiser.transformer)]
    to_q = denoiser.transformer.transformer_blocks[0].attn.to_q
    push = {"transformer_blocks.0.attn.to_q.weight": torch.zeros(to_q.weight.shape)}
    with pytest.raises(FailedPrecondition, match=r"quantised to FP8 here \(--quantization fp8\)"):
        planned_copies(modules, push)
    assert "transformer_blocks.0.attn.to_q.weight_scale" not in denoiser.transformer.state_dict()
    kept = {"proj_out.weight": torch.zeros(denoiser.transformer.proj_out.weight.shape)}
    assert len(planned_copies(modules, kept)) == 1


def test_lora_adapters_apply_to_fp8_layers(tiny_model: Path, tmp_path: Path) -> None:
    """An adapter's term is added to the FP8 product (its hook sees the model-dtype input): the
    adapted FP8 latents stay within FP8 rounding of the adapted fp32 ones, and far closer to
    them than the unadapted FP8 latents are (this adapter moves the latents by ~3%, FP8 by
    ~0.1%: a quarter of the adapter's effect is the bound)."""
    plain, fp8 = load(tiny_model), load(tiny_model, "fp8")
    path = save_random_lora(tmp_path / "ink.safetensors", plain.transformer, seed=1)
    for denoiser in (plain, fp8):
        denoiser.loras.add("ink", path)
    expected = denoised(plain, False, (("ink", 1.0),))
    error = relative_rms(denoised(fp8, False, (("ink", 1.0),)), expected)
    unadapted = relative_rms(denoised(fp8, False), expected)
    print(f"adapted fp8 against adapted fp32: {error:.3g}; unadapted fp8: {unadapted:.3g}")
    assert 0 < error <= min(ROUNDING, unadapted / 4)
