"""What a failover promises (issue 38, finding 11), pinned on the Qwen-Image runners.

A checkpoint holds the latents and the step index; the scheduler's state (sigmas, timesteps)
follows from the request, and Qwen-Image's Euler steps draw no random numbers after the
initial noise. So a request resumed from a checkpoint continues exactly: alone in its forward,
it ends bit for bit as the uninterrupted run (fp32 and bf16). What differs after a real
failover is the batch: the replica it resumes on steps it together with other requests, and a
batched forward equals a lone one only up to reduction order (tests/unit/models/test_batching.py). That
difference, measured here, is the one any request sees between a lone and a batched run.
"""

from __future__ import annotations

import pytest
import torch

from omni_common.models.base import GenerationRequest

REQUEST = GenerationRequest(prompt="a red cat", width=32, height=32, num_inference_steps=6, seed=5)
OTHER = GenerationRequest(prompt="a blue dog on a mat", width=32, height=32, num_inference_steps=6, seed=6)


def run(denoiser, states) -> None:
    while not all(denoiser.is_done(s) for s in states):
        denoiser.step([s for s in states if not denoiser.is_done(s)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_request_resumed_alone_ends_bitwise_as_the_uninterrupted_one(split_runners, dtype) -> None:
    encoder, denoiser, _ = split_runners(dtype)
    [embeds] = encoder.encode([REQUEST])
    uninterrupted = denoiser.prepare(REQUEST, embeds)
    run(denoiser, [uninterrupted])
    expected = denoiser.finish(uninterrupted).tensors["latents"]

    first = denoiser.prepare(REQUEST, embeds)
    for _ in range(2):
        denoiser.step([first])
    checkpoint = denoiser.checkpoint(first)
    denoiser.release(first)
    resumed = denoiser.prepare(REQUEST, embeds)  # as the other replica prepares it
    denoiser.restore(resumed, checkpoint)
    run(denoiser, [resumed])
    assert torch.equal(denoiser.finish(resumed).tensors["latents"], expected)


def test_a_request_resumed_in_a_batch_differs_only_by_batching_rounding(split_runners) -> None:
    encoder, denoiser, decoder = split_runners(torch.float32)
    embeds, other_embeds = encoder.encode([REQUEST, OTHER])
    uninterrupted = denoiser.prepare(REQUEST, embeds)
    run(denoiser, [uninterrupted])
    expected = denoiser.finish(uninterrupted)

    first = denoiser.prepare(REQUEST, embeds)
    for _ in range(3):
        denoiser.step([first])
    checkpoint = denoiser.checkpoint(first)
    denoiser.release(first)
    resumed, companion = denoiser.prepare(REQUEST, embeds), denoiser.prepare(OTHER, other_embeds)
    denoiser.restore(resumed, checkpoint)
    run(denoiser, [resumed, companion])
    got = denoiser.finish(resumed)
    denoiser.finish(companion)
    latents_diff = float((got.tensors["latents"] - expected.tensors["latents"]).abs().max())
    got_image, expected_image = decoder.decode([got, expected])
    pixels = (got_image.clamp(0, 1) * 255).round() - (expected_image.clamp(0, 1) * 255).round()
    worst_pixel = float(pixels.abs().max())
    print(f"resumed in a batch vs uninterrupted: latents {latents_diff:.3g}, 8-bit pixels {worst_pixel:g}")
    assert latents_diff <= 1e-5  # test_batching.py's bound for a batched forward
    assert worst_pixel <= 1
