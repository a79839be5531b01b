"""Packed modulation (modulation.py): the DiT's timestep modulation computed once per
schedule gives the latents of the plain denoiser, alone, batched and with CFG, on the CPU
(fp32: only the batched product of the modulation layers rounds differently, ~1e-7 on
latents of magnitude ~3); the transformer still takes a plain timestep; a weight change
clears the tables, and the tables are shared by requests of one schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.modulation import ModulationCache
from omni_common.models.qwenimage.step_cache import StepCache, cached_forward

from ..conftest import CPU
from .test_batching import ATOL, LONG, SHORT, denoise
from .test_graphs import inputs


@pytest.fixture(scope="module")
def runners(tiny_model: Path):
    encoder = QwenImageEncoder.load(tiny_model, CPU, torch.float32)
    plain = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
    packed = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
    packed.modulation = ModulationCache(packed.transformer)
    return encoder, plain, packed


STEP_CACHED = (("step_cache", "1.0"),)  # reuses steps 2 and 3 of 4 on the tiny model


@pytest.mark.parametrize("options", [(), STEP_CACHED], ids=["plain", "step-cached"])
@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_packed_modulation_gives_the_plain_latents(runners, cfg: float, options) -> None:
    encoder, plain, packed = runners
    requests = [
        GenerationRequest(
            prompt=p,
            negative_prompt="blurry",
            width=32,
            height=32,
            num_inference_steps=4,
            seed=i,
            true_cfg_scale=cfg,
            options=options,
        )
        for i, p in enumerate([SHORT, LONG])
    ]
    for starts in ([0], [0, 1]):  # alone, then batched (joining one step late)
        chosen = requests[: len(starts)]
        expected, _ = denoise((encoder, plain, None), chosen, starts)
        got, _ = denoise((encoder, packed, None), chosen, starts)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g.tensors["latents"], e.tensors["latents"], atol=ATOL, rtol=0)


def step_cached_forward(transformer, inputs, img_shapes) -> torch.Tensor:
    """The step cache's forward of one request's rows, computing every block."""
    return cached_forward(transformer, inputs, img_shapes, [StepCache(1.0)], [True])


@pytest.mark.parametrize("forward", [transformer_forward, step_cached_forward], ids=["plain", "step-cached"])
def test_the_packed_forward_reads_the_rows_not_the_timestep(runners, forward) -> None:
    """The check above can fail: packed rows of another timestep change the output."""
    _, _, packed = runners
    plain_inputs, img_shapes = inputs(packed, 2, [5, 7])
    cache = packed.modulation
    rows = cache.table(("test", 900, 100), torch.tensor([900.0, 100.0]), torch.float32)
    with torch.inference_mode():
        expected = forward(packed.transformer, plain_inputs, img_shapes)  # timesteps 900, 500
        same = forward(packed.transformer, {**plain_inputs, "modulation": rows[:1].expand(2, -1)}, img_shapes)
    assert (same[1] - expected[1]).abs().max() > 1e-3  # row 1 got 900's rows, not 500's
    torch.testing.assert_close(same[0], expected[0], atol=ATOL, rtol=0)


def test_requests_of_one_schedule_share_a_table_until_the_weights_change(runners) -> None:
    encoder, _, packed = runners
    request = GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=3, seed=0)
    (embeds,) = encoder.encode([request])
    first, second = packed.prepare(request, embeds), packed.prepare(request, embeds)
    assert first.modulation is second.modulation and first.modulation.shape == (3, packed.modulation.width)
    packed.weights_changed()
    assert packed.prepare(request, embeds).modulation is not first.modulation
    for state in (first, second):
        packed.release(state)
