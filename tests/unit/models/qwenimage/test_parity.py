"""The split Qwen-Image run (encode -> step-wise denoise -> decode) reproduces diffusers'
monolithic QwenImagePipeline bit for bit."""

from __future__ import annotations

import pytest
import torch

from omni_common.models.base import GenerationRequest, StageState

PROMPT = "a red cat sitting on a blue mat"
NEGATIVE = "blurry, low quality, watermark"


def run_split(runners, request: GenerationRequest) -> tuple[StageState, torch.Tensor]:
    encoder, denoiser, decoder = runners
    encoded = encoder.encode([request])[0]
    state = denoiser.prepare(request, encoded)
    steps = 0
    while not denoiser.is_done(state):
        denoiser.step([state])
        steps += 1
    assert steps == request.num_inference_steps
    return encoded, decoder.decode([denoiser.finish(state)])[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_split_run_equals_pipeline_bitwise(
    dtype: torch.dtype, cfg: bool, reference_pipeline, split_runners
) -> None:
    request = GenerationRequest(
        prompt=PROMPT,
        negative_prompt=NEGATIVE if cfg else "",
        width=64,
        height=64,
        num_inference_steps=4,
        true_cfg_scale=4.0 if cfg else 1.0,
        seed=1234,
    )
    encoded, image = run_split(split_runners(dtype), request)
    expected_names = {"prompt_embeds"} | ({"negative_prompt_embeds"} if cfg else set())
    assert set(encoded.tensors) == expected_names
    assert encoded.tensors["prompt_embeds"].dtype == dtype

    reference = reference_pipeline(dtype)(
        PROMPT,
        negative_prompt=NEGATIVE if cfg else None,
        width=64,
        height=64,
        num_inference_steps=4,
        true_cfg_scale=request.true_cfg_scale,
        generator=torch.Generator().manual_seed(request.seed),
        output_type="pt",
    ).images[0]

    assert image.dtype == torch.float32 and image.shape == (3, 64, 64)
    assert image.std() > 0  # a real image, not a constant
    assert torch.equal(image, reference.float())
    pixels = (image * 255).round().to(torch.uint8)
    assert torch.equal(pixels, (reference.float() * 255).round().to(torch.uint8))


def test_interleaved_requests_match_sequential_runs(split_runners) -> None:
    """Each request owns its scheduler: stepping two in turn changes nothing."""
    encoder, denoiser, _ = split_runners(torch.float32)
    requests = [
        GenerationRequest(prompt=PROMPT, width=64, height=64, num_inference_steps=3, seed=1),
        GenerationRequest(prompt="a dog", width=64, height=32, num_inference_steps=5, seed=2),
    ]
    alone = []
    for request in requests:
        state = denoiser.prepare(request, encoder.encode([request])[0])
        while not denoiser.is_done(state):
            denoiser.step([state])
        alone.append(denoiser.finish(state).tensors["latents"])
    states = [denoiser.prepare(r, s) for r, s in zip(requests, encoder.encode(requests), strict=True)]
    while not all(denoiser.is_done(s) for s in states):
        for state in states:  # different sizes, so different batch keys: one step() each
            if not denoiser.is_done(state):
                denoiser.step([state])
    for state, expected in zip(states, alone, strict=True):
        assert torch.equal(denoiser.finish(state).tensors["latents"], expected)
