"""The Qwen-Image denoiser's step cache (the "step_cache" option, a first-block cache): off, it
changes nothing; with every request missing, its forward is bitwise the transformer's; on, it
reuses steps (never the first or last) and stays close to the exact run; in a batch, each
request decides for itself.

Closeness. On the tiny random model the first block's residual moves by a relative L1 of
0.39-0.74 from the last computed step (it grows with the steps since), so thresholds 0.1 and
0.2 never hit and 1.0 hits every step but the first and the last. Final latents against the
exact run's, PSNR with the exact latents' range as peak, 64x64, 10 steps, measured: threshold
1.0 (8 of 10 reused) 61.2 dB (max |diff| 2.5e-2, relative L2 6.2e-3); block 0 alone every
step (the tail dropped) 52.2 dB; 2 steps instead of 10 (as many full forwards) 35.7 dB.
MIN_PSNR = 55 dB holds with 6 dB to spare and fails a cache that loses the tail.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omni_common.errors import FailedPrecondition, InvalidArgument
from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.denoise import QwenImageDenoiser, QwenImageDenoiseState
from omni_common.models.qwenimage.execution import forward_inputs, transformer_forward
from omni_common.models.qwenimage.family import QwenImageFamily
from omni_common.models.qwenimage.step_cache import StepCache, cached_forward
from omni_common.runtime.layerwise_offload import LayerwiseOffload
from tests.unit.models.conftest import CPU

SHORT, LONG = "a cat", "a red cat sitting on a blue mat under a green tree"
NEGATIVE = "blurry, low quality, watermark"
ATOL = 1e-5  # batched vs alone (test_batching.py's tolerance and its reasons)
MIN_PSNR = 55.0


def cached(request: GenerationRequest, threshold: str) -> GenerationRequest:
    return replace(request, options=(("step_cache", threshold),))


def prepare(runners, requests: Sequence[GenerationRequest]) -> list[QwenImageDenoiseState]:
    encoder, denoiser, _ = runners
    return [denoiser.prepare(r, e) for r, e in zip(requests, encoder.encode(requests), strict=True)]


def run(runners, requests: Sequence[GenerationRequest]) -> list[QwenImageDenoiseState]:
    """All requests stepped together until each is done (finished states, not finish()ed)."""
    denoiser = runners[1]
    states = prepare(runners, requests)
    while not all(denoiser.is_done(s) for s in states):
        denoiser.step([s for s in states if not denoiser.is_done(s)])
    return states


def psnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    peak = (expected.max() - expected.min()).item()
    mse = ((actual - expected) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


@pytest.mark.parametrize("cfg", [False, True])
def test_cached_forward_with_every_row_missing_is_the_plain_forward(split_runners, cfg: bool) -> None:
    runners = split_runners(torch.float32)
    negative = NEGATIVE if cfg else ""
    requests = [
        GenerationRequest(prompt=prompt, negative_prompt=negative, width=32, height=32, seed=seed)
        for seed, prompt in enumerate([SHORT, LONG])
    ]
    states = prepare(runners, requests)
    batch = runners[1]._batch_inputs(states)
    assert batch.mask is not None  # prompts of two lengths: padded
    inputs = forward_inputs(batch.latents, batch.timestep, batch.embeds, batch.mask)
    with torch.inference_mode():
        expected = transformer_forward(runners[1].transformer, inputs, batch.img_shapes)
        caches = [StepCache(1.0), StepCache(1.0)]  # empty: a first step computes
        got = cached_forward(runners[1].transformer, inputs, batch.img_shapes, caches, [False, False])
    assert torch.equal(got, expected)
    rows = 2 if cfg else 1
    for cache in caches:
        assert cache.first_residual is not None and cache.tail_residual is not None
        assert (
            cache.first_residual.shape == cache.tail_residual.shape == (rows, 16, 48)
        )  # 4x4 patches, 3 heads x 16
        assert (cache.steps, cache.cached_steps) == (1, 0)


def test_threshold_zero_is_bitwise_the_uncached_run(split_runners) -> None:
    runners = split_runners(torch.float32)
    plain = GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=4, seed=1)
    (off,), (exact,) = run(runners, [cached(plain, "0")]), run(runners, [plain])
    assert off.step_cache is None
    assert runners[1].batch_key(off) == runners[1].batch_key(exact)
    assert torch.equal(off.latents, exact.latents)
    # On, with a threshold no step meets: the cached path, every step computed, same latents.
    (never,) = run(runners, [cached(plain, "0.1")])
    assert never.step_cache is not None and never.step_cache.cached_steps == 0
    assert torch.equal(never.latents, exact.latents)


def test_a_large_threshold_reuses_all_but_the_first_and_last_steps(
    split_runners, caplog: pytest.LogCaptureFixture
) -> None:
    runners = split_runners(torch.float32)
    denoiser = runners[1]
    plain = GenerationRequest(prompt=SHORT, width=64, height=64, num_inference_steps=10, seed=1)
    (exact,) = run(runners, [plain])
    (state,) = prepare(runners, [cached(plain, "1.0")])
    cache = state.step_cache
    assert cache is not None
    reused = []
    while not denoiser.is_done(state):
        before = cache.cached_steps
        denoiser.step([state])
        reused.append(cache.cached_steps - before)
    assert reused == [0] + [1] * 8 + [0]
    assert torch.isfinite(state.latents).all()
    assert not torch.equal(state.latents, exact.latents)
    assert psnr(state.latents, exact.latents) > MIN_PSNR
    with caplog.at_level(logging.INFO, logger="omnistage.step_cache"):
        denoiser.finish(state)
    assert "step cache reused 8 of 10 steps" in caplog.text
    assert cache.first_residual is None and cache.tail_residual is None  # dropped at finish


@pytest.mark.parametrize("cfg", [False, True])
def test_a_batch_with_a_hit_and_a_miss_equals_each_request_alone(split_runners, cfg: bool) -> None:
    runners = split_runners(torch.float32)
    negative = NEGATIVE if cfg else ""
    hitting = GenerationRequest(
        prompt=SHORT, negative_prompt=negative, width=32, height=32, num_inference_steps=5
    )
    missing = replace(hitting, prompt=LONG, seed=7)
    requests = [cached(hitting, "1.0"), cached(missing, "0.2")]
    batched = run(runners, requests)
    alone = [run(runners, [request])[0] for request in requests]
    counts = [(s.step_cache.steps, s.step_cache.cached_steps) for s in batched if s.step_cache]
    assert counts == [(5, 3), (5, 0)]  # steps 1-3 had one hit and one miss in one forward
    for got, expected in zip(batched, alone, strict=True):
        assert got.step_cache is not None and expected.step_cache is not None
        assert got.step_cache.cached_steps == expected.step_cache.cached_steps
        torch.testing.assert_close(got.latents, expected.latents, atol=ATOL, rtol=0)


def test_cached_requests_batch_only_with_cached_ones(split_runners) -> None:
    runners = split_runners(torch.float32)
    denoiser = runners[1]
    plain = GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=2)
    low, high, off = prepare(runners, [cached(plain, "0.05"), cached(plain, "0.5"), plain])
    assert denoiser.batch_key(low) == denoiser.batch_key(high) != denoiser.batch_key(off)
    with pytest.raises(ValueError, match="batch key"):
        denoiser.step([low, off])


def test_a_restored_request_starts_with_an_empty_cache(split_runners) -> None:
    runners = split_runners(torch.float32)
    denoiser = runners[1]
    request = cached(GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=6), "1.0")
    (state,) = prepare(runners, [request])
    for _ in range(3):
        denoiser.step([state])
    checkpoint = denoiser.checkpoint(state)
    (resumed,) = prepare(runners, [request])
    denoiser.restore(resumed, checkpoint)
    assert resumed.step_cache is not None and resumed.step_cache.first_residual is None
    denoiser.step([resumed])  # step 3: nothing cached yet, computes
    denoiser.step([resumed])  # step 4: reuses
    assert (resumed.step_cache.steps, resumed.step_cache.cached_steps) == (2, 1)


def test_the_option_is_on_the_card_and_validated() -> None:
    family = QwenImageFamily()
    (spec,) = [spec for spec in family.card.options if spec.name == "step_cache"]
    assert (spec.type, spec.default, spec.minimum, spec.maximum) == ("float", "0", 0, 1)
    request = GenerationRequest(prompt=SHORT)
    for good in ("0", "0.1", "1"):
        family.validate(cached(request, good))
    for bad in ("1.5", "-0.1", "nan", "fast"):
        with pytest.raises(InvalidArgument, match="step_cache"):
            family.validate(cached(request, bad))


def test_layerwise_offload_refuses_the_step_cache(split_runners, tiny_model: Path) -> None:
    """Skipped blocks would break the offload's prefetch cycle (step_cache.check_cacheable)."""
    encoder = split_runners(torch.float32)[0]
    denoiser = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)  # its own: offload moves weights
    offload = LayerwiseOffload(denoiser.transformer.transformer_blocks, CPU)
    try:
        request = GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=2)
        inputs = encoder.encode([request])[0]
        with pytest.raises(FailedPrecondition, match="offload"):
            denoiser.prepare(cached(request, "0.1"), inputs)
        denoiser.prepare(request, inputs)  # uncached requests are unaffected
    finally:
        offload.close()
