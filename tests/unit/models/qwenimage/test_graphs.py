"""What the CUDA-graph path of the Qwen-Image DiT changes about a forward, checked on the CPU
(tests/gpu/test_cuda_graphs.py replays real graphs): the buckets, the padding, and the
capture-safe swap of diffusers' text-mask helper.

Padding tolerance: a padded forward differs from the plain one only in reduction order (a
batch of another size, masked keys); on the tiny fp32 fixture that is ~1e-7 on outputs of
magnitude ~1. Without the mask the padded prompt tokens would move the output by ~1e-2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage

from omni_common.models.base import DenoiserOptions
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.graphs import (
    BATCH_BUCKETS,
    TEXT_BUCKETS,
    bucket,
    capturable_text_mask,
    graph_key,
    padded_inputs,
)
from omni_common.models.qwenimage.warmup import WarmUp, warm_up
from omni_common.runtime.config import parse_sizes
from omni_common.runtime.parallel_mode import ParallelPolicy, spreads

from ..conftest import CPU

ATOL = 1e-5


@pytest.fixture(scope="module")
def denoiser(tiny_model: Path):
    return QwenImageDenoiser.load(tiny_model, CPU, torch.float32)


def inputs(denoiser, rows: int, lengths: list[int], seed: int = 0) -> tuple[dict[str, torch.Tensor], list]:
    """Random latents/timesteps and prompts of `lengths` tokens, right-padded with a mask as
    the batched step builds them."""
    config = denoiser.transformer.config
    generator = torch.Generator().manual_seed(seed)
    img_shape = denoiser.img_shape(64, 64)
    tokens = img_shape[1] * img_shape[2]
    longest = max(lengths)
    embeds = torch.randn((rows, longest, config["joint_attention_dim"]), generator=generator)
    mask = torch.zeros((rows, longest), dtype=torch.long)
    for row, length in enumerate(lengths):
        embeds[row, length:] = 0
        mask[row, :length] = 1
    return {
        "latents": torch.randn((rows, tokens, config["in_channels"]), generator=generator),
        "timestep": torch.tensor([900.0, 500.0, 100.0][:rows]),
        "embeds": embeds,
        "mask": mask,
    }, [[img_shape]] * rows


def test_bucket_is_the_smallest_that_holds_the_value() -> None:
    assert bucket(1, BATCH_BUCKETS) == 1
    assert bucket(3, BATCH_BUCKETS) == 4
    assert bucket(8, BATCH_BUCKETS) == 8
    assert bucket(33, TEXT_BUCKETS) == 64
    assert bucket(TEXT_BUCKETS[-1] + 1, TEXT_BUCKETS) is None


def test_masked_prompts_pad_to_eight_tokens_and_share_their_bucket_s_decision() -> None:
    shape = (1, 32, 32)
    masked = [graph_key(8, shape, length, True, torch.bfloat16, True) for length in (25, 32, 33, 37, 64)]
    assert [key.text for key in masked if key] == [32, 32, 40, 40, 64]
    assert all(key and key.batch == 8 for key in masked)
    first, _, third, fourth, fifth = masked
    assert first and third and fourth and fifth
    assert third.graph == fourth.graph and third.graph != fifth.graph  # 33 and 37 tokens: one graph
    assert third.decision == fifth.decision != first.decision  # timed once per text bucket
    alone = graph_key(1, shape, 37, False, torch.bfloat16, True)
    assert alone and alone.text == 37 and alone.batch == 1  # unmasked: the prompt's own length
    assert graph_key(64, shape, 37, True, torch.bfloat16, True) is None  # no batch bucket of 64


def test_padding_to_buckets_leaves_each_request_its_own_output(denoiser) -> None:
    plain, img_shapes = inputs(denoiser, 3, [5, 11, 7])
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    padded = padded_inputs(plain["latents"], plain["timestep"], plain["embeds"], plain["mask"], 4, 32)
    assert padded["embeds"].shape[:2] == (4, 32) and padded["mask"].shape == (4, 32)
    assert padded["mask"][:3, 11:].sum() == 0  # the padded prompt tokens are masked out
    got = transformer_forward(denoiser.transformer, padded, [img_shapes[0]] * 4)[:3]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_an_unmasked_prompt_gets_a_mask_that_hides_only_the_padding(denoiser) -> None:
    plain, img_shapes = inputs(denoiser, 1, [9])
    del plain["mask"]
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    padded = padded_inputs(plain["latents"], plain["timestep"], plain["embeds"], None, 1, 32)
    assert padded["mask"].tolist() == [[1] * 9 + [0] * 23]
    got = transformer_forward(denoiser.transformer, padded, img_shapes)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_prompts_of_the_bucket_length_are_passed_as_they_are(denoiser) -> None:
    """Equal unmasked prompts padded to their own length: no mask, nothing changed (the graph
    of an exact prompt length keeps the unmasked attention kernel)."""
    plain, img_shapes = inputs(denoiser, 1, [9])
    del plain["mask"]
    padded = padded_inputs(plain["latents"], plain["timestep"], plain["embeds"], None, 2, 9)
    assert "mask" not in padded and padded["embeds"].shape[:2] == (2, 9)
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    got = transformer_forward(denoiser.transformer, padded, img_shapes * 2)[:1]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_without_the_mask_padding_would_change_the_output(denoiser) -> None:
    """The check above can fail: dropping the mask moves the output far beyond ATOL."""
    plain, img_shapes = inputs(denoiser, 1, [9])
    del plain["mask"]
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    padded = padded_inputs(plain["latents"], plain["timestep"], plain["embeds"], None, 1, 32)
    del padded["mask"]
    got = transformer_forward(denoiser.transformer, padded, img_shapes)
    assert (got - expected).abs().max() > 100 * ATOL


def test_the_capture_safe_mask_helper_leaves_the_forward_bitwise_unchanged(denoiser) -> None:
    plain, img_shapes = inputs(denoiser, 3, [5, 11, 7])
    expected = transformer_forward(denoiser.transformer, plain, img_shapes)
    original = transformer_qwenimage.compute_text_seq_len_from_mask
    with capturable_text_mask():
        assert transformer_qwenimage.compute_text_seq_len_from_mask is not original
        got = transformer_forward(denoiser.transformer, plain, img_shapes)
    assert transformer_qwenimage.compute_text_seq_len_from_mask is original
    assert torch.equal(got, expected)


def test_cuda_graphs_on_the_cpu_are_refused_with_a_reason(tiny_model: Path) -> None:
    from omni_common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="CUDA graphs need a CUDA device"):
        QwenImageDenoiser.load(tiny_model, CPU, torch.float32, DenoiserOptions(cuda_graphs=True))


def test_capture_sizes_parse_as_width_by_height() -> None:
    assert parse_sizes("512x512, 1024x768") == ((512, 512), (1024, 768))
    assert parse_sizes("") == ()
    with pytest.raises(SystemExit, match="WIDTHxHEIGHT"):
        parse_sizes("512")


Shapes = list[tuple[int, int, int]]  # a forward's rows, prompt tokens and image tokens


def warm_up_recorded(
    tiny_model: Path,
    sizes: list[int],
    defer: bool,
    only: Callable[[int, tuple[int, int, int]], bool] | None = None,
) -> tuple[WarmUp, Shapes]:
    """The tiny denoiser's warm-up (CPU: no graphs) for square `sizes`, up to 2 requests (those
    `only` picks), and the Shapes of its forwards as they run (the list grows with later steps)."""
    denoiser = QwenImageDenoiser.load(tiny_model, torch.device("cpu"), torch.float32)
    config = denoiser.transformer.config
    shapes: Shapes = []

    def forward(inputs, img_shapes):
        rows, tokens = inputs["embeds"].shape[:2]
        shapes.append((rows, tokens, inputs["latents"].shape[1]))
        return transformer_forward(denoiser.transformer, inputs, img_shapes)

    warm = warm_up(
        forward, None, [denoiser.img_shape(size, size) for size in sizes], 2, config["in_channels"],
        config["joint_attention_dim"], torch.float32, torch.device("cpu"), defer=defer,
        **({} if only is None else {"only": only}),
    )  # fmt: skip
    return warm, shapes


def test_the_warm_up_runs_every_shape_and_says_how_far_it_is(tiny_model: Path, caplog) -> None:
    with caplog.at_level("INFO", logger="omnistage.warmup"):
        warm, shapes = warm_up_recorded(tiny_model, [64], defer=False)
    assert shapes == [(1, 17, 64), (1, 23, 64), (1, 23, 64), (2, 17, 64), (2, 23, 64), (2, 23, 64)]
    assert warm.left == 0 and not warm.run_next()
    assert "warm-up 6/6: batch 2 at 8x8 patches, prompts of different lengths (masked)" in caplog.text


def test_a_deferred_warm_up_runs_one_request_at_each_size_then_the_rest_in_order(tiny_model: Path) -> None:
    """A warm start serves once one request at each size runs compiled; the other steps run
    one per idle call, in the order a full warm-up runs them (the compiler generalises shapes
    in that order: the same graphs load from the cache)."""
    _, everything = warm_up_recorded(tiny_model, [64, 32], defer=False)
    warm, shapes = warm_up_recorded(tiny_model, [64, 32], defer=True)
    assert shapes == [(1, 17, 64), (1, 23, 64), (1, 17, 16), (1, 23, 16)]  # unmasked, each size
    assert warm.left == len(everything) - 4
    while warm.run_next():
        pass
    assert shapes == everything and warm.left == 0


def test_a_rehearsal_runs_only_the_shapes_its_replica_can_spread(tiny_model: Path) -> None:
    """A replica over 2 devices rehearses spread only what its policy can spread (auto: one
    request from --sequence-parallel-tokens on), in the full warm-up's order; forced sequence
    parallel, all of it."""
    _, everything = warm_up_recorded(tiny_model, [64, 32], defer=False)
    # The tiny fixture's 64x64 image is 64 tokens a step, 32x32 is 16: the threshold between.
    auto = ParallelPolicy(sequence_parallel_tokens=64)

    def picked(policy: ParallelPolicy) -> Shapes:
        _, shapes = warm_up_recorded(
            tiny_model,
            [64, 32],
            defer=False,
            only=lambda rows, shape: spreads(rows, math.prod(shape), 2, policy),
        )
        return shapes

    assert picked(auto) == [(1, 17, 64), (1, 23, 64), (1, 23, 64)]  # one request at 64x64, masked too
    assert picked(ParallelPolicy("sequence-parallel")) == everything
    assert picked(ParallelPolicy("data-parallel")) == []
