"""Step-level batching of the Qwen-Image runners: a request's result from a batched run equals
its result alone up to float rounding.

Tolerance. On fp32 the batched and lone runs differ only in reduction order (matmuls and
attention over a batch of another size, the padded keys masked out). Measured on these cases:
final latents (magnitude ~3) <= 1.0e-6 apart (CFG; <= 4.8e-7 without), images <= 4.8e-7,
encoder embeddings <= 2.4e-7, decoder images <= 4.2e-7. ATOL = 1e-5 leaves a 10x margin and is
far below what a batching bug gives: without the padding mask the short prompt's latents move
by 2.4e-2 after three steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from omni_common.models.base import GenerationRequest, StageState

ATOL = 1e-5
SHORT = "a cat"
LONG = "a red cat sitting on a blue mat under a green tree"
NEGATIVE = "blurry, low quality, watermark"


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def denoise(
    runners, requests: Sequence[GenerationRequest], starts: Sequence[int]
) -> tuple[list[StageState], list[int]]:
    """A toy step scheduler: request i joins at tick starts[i]; each tick steps every joined,
    unfinished request in one step() call. The final states and the batch size of each tick."""
    encoder, denoiser, _ = runners
    states = [denoiser.prepare(r, e) for r, e in zip(requests, encoder.encode(requests), strict=True)]
    batch_sizes = []
    tick = 0
    while not all(denoiser.is_done(s) for s in states):
        ready = [
            s for s, start in zip(states, starts, strict=True) if start <= tick and not denoiser.is_done(s)
        ]
        denoiser.step(ready)
        batch_sizes.append(len(ready))
        tick += 1
    return [denoiser.finish(s) for s in states], batch_sizes


def assert_batched_equals_alone(
    runners, requests: Sequence[GenerationRequest], starts: Sequence[int]
) -> list[int]:
    """Final latents and images of each request, batched vs alone, within ATOL."""
    batched, batch_sizes = denoise(runners, requests, starts)
    alone = [denoise(runners, [request], [0])[0][0] for request in requests]
    for got, expected in zip(batched, alone, strict=True):
        assert got.meta == expected.meta
        assert_close(got.tensors["latents"], expected.tensors["latents"])
    images = runners[2].decode(batched + alone)  # one decoder call: only the denoiser differs
    for got, expected in zip(images[: len(requests)], images[len(requests) :], strict=True):
        assert got.std() > 0
        assert_close(got, expected)
    return batch_sizes


def test_requests_at_different_steps_with_different_prompts_batch(split_runners) -> None:
    requests = [
        GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=5, seed=1),
        GenerationRequest(prompt=LONG, width=32, height=32, num_inference_steps=5, seed=2),
    ]
    batch_sizes = assert_batched_equals_alone(split_runners(torch.float32), requests, starts=[0, 2])
    assert batch_sizes == [1, 1, 2, 2, 2, 1, 1]


def test_requests_with_different_step_counts_finish_at_their_own_time(split_runners) -> None:
    requests = [
        GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=3, seed=3),
        GenerationRequest(prompt=LONG, width=32, height=32, num_inference_steps=5, seed=4),
    ]
    batch_sizes = assert_batched_equals_alone(split_runners(torch.float32), requests, starts=[0, 0])
    assert batch_sizes == [2, 2, 2, 1, 1]


def test_cfg_requests_share_one_doubled_forward(split_runners, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [
        GenerationRequest(
            prompt=SHORT, negative_prompt=NEGATIVE, width=32, height=32, num_inference_steps=4, seed=5
        ),
        GenerationRequest(
            prompt=LONG,
            negative_prompt="blurry",
            true_cfg_scale=3.0,
            width=32,
            height=32,
            num_inference_steps=4,
            seed=6,
        ),
    ]
    denoiser = split_runners(torch.float32)[1]
    forwards = 0
    original = denoiser._forward

    def counting_forward(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(denoiser, "_forward", counting_forward)
        denoise(split_runners(torch.float32), requests, starts=[0, 0])
    assert forwards == 4  # one 2B forward per step, cond and uncond together
    batch_sizes = assert_batched_equals_alone(split_runners(torch.float32), requests, starts=[0, 1])
    assert batch_sizes == [1, 2, 2, 2, 1]


def test_encoder_batch_equals_each_request_alone(split_runners) -> None:
    encoder = split_runners(torch.float32)[0]
    requests = [
        GenerationRequest(prompt=SHORT),
        GenerationRequest(prompt=LONG, negative_prompt=NEGATIVE, true_cfg_scale=4.0),
        GenerationRequest(prompt=LONG, max_sequence_length=3),
    ]
    batched = encoder.encode(requests)
    for request, got in zip(requests, batched, strict=True):
        expected = encoder.encode([request])[0]
        assert set(got.tensors) == set(expected.tensors)  # no masks: each is trimmed to its text
        for name, tensor in expected.tensors.items():
            assert got.tensors[name].shape == tensor.shape
            assert_close(got.tensors[name], tensor)
    assert batched[2].tensors["prompt_embeds"].shape[1] == 3
    assert encoder.encode([]) == []


def test_decoder_batches_by_size_and_keeps_the_order(split_runners) -> None:
    decoder = split_runners(torch.float32)[2]
    generator = torch.Generator().manual_seed(0)
    states = [
        StageState(
            tensors={"latents": torch.randn(1, (height // 8) * (width // 8), 16, generator=generator)},
            meta={"height": str(height), "width": str(width)},
        )
        for height, width in [(32, 32), (16, 32), (32, 32)]
    ]
    images = decoder.decode(states)
    for state, image in zip(states, images, strict=True):
        expected = decoder.decode([state])[0]
        assert image.shape == expected.shape == (3, int(state.meta["height"]), int(state.meta["width"]))
        assert_close(image, expected)


def test_step_rejects_states_of_different_batch_keys(split_runners) -> None:
    encoder, denoiser, _ = split_runners(torch.float32)
    requests = [
        GenerationRequest(prompt=SHORT, width=32, height=32, num_inference_steps=2),
        GenerationRequest(prompt=SHORT, width=32, height=16, num_inference_steps=2),
        GenerationRequest(prompt=SHORT, negative_prompt=NEGATIVE, width=32, height=32, num_inference_steps=2),
    ]
    a, other_size, cfg = (
        denoiser.prepare(r, e) for r, e in zip(requests, encoder.encode(requests), strict=True)
    )
    for mixed in ([a, other_size], [a, cfg]):
        with pytest.raises(ValueError, match="batch key"):
            denoiser.step(mixed)
    assert a.step_index == 0  # nothing stepped
    with pytest.raises(ValueError, match="same state"):
        denoiser.step([a, a])
    denoiser.step([a])
    denoiser.step([a])
    with pytest.raises(ValueError, match="finished"):
        denoiser.step([a])
