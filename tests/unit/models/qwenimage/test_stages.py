"""Stage-level behaviour of the Qwen-Image runners: encoder masks, denoiser shapes and keys,
decoder input checks."""

from __future__ import annotations

import copy

import pytest
import torch

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.qwenimage.encode import GRAPH_BUCKET_TOKENS, PROMPT_TEMPLATE_DROP, template_tokens

SHORT, LONG = "a cat", "a red cat sitting on a blue mat under a green tree"


def test_single_prompt_has_no_mask(split_runners) -> None:
    encoder = split_runners(torch.float32)[0]
    request = GenerationRequest(prompt=SHORT, negative_prompt=LONG, true_cfg_scale=4.0)
    tensors = encoder.encode([request])[0].tensors
    assert set(tensors) == {"prompt_embeds", "negative_prompt_embeds"}
    assert tensors["prompt_embeds"].shape[0] == 1 and tensors["prompt_embeds"].shape[2] == 16


def test_a_gpu_encoder_keeps_cudnn_attention_out_and_the_cpu_keeps_its_own(split_runners) -> None:
    """cuDNN's attention builds a plan per new prompt length (60-110 ms an encode on an H200):
    on a GPU the prompt forward runs with flash or memory-efficient attention; the CPU's
    choice, and so its parity with diffusers, is untouched."""
    encoder, _, _ = split_runners(torch.float32)
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    with encoder._attention():
        assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    gpu = copy.copy(encoder)
    gpu.device = torch.device("cuda", 0)  # only the flags are read: no GPU is needed
    with gpu._attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before


def test_a_prompt_padded_at_its_end_keeps_its_states(split_runners) -> None:
    """What a lone prompt's CUDA graph relies on (QwenImageEncoder.use_cuda_graphs): its tokens
    padded at the end to a graph's bucket get the states the full model's forward gives the
    unpadded prompt, since causal attention keeps them from seeing the padding."""
    encoder = split_runners(torch.float32)[0]
    want = encoder.embed_texts([LONG], alone=True)[0]
    ids = template_tokens(encoder.tokenizer, [LONG], return_tensors="pt").input_ids
    padded = torch.cat([ids, torch.full((1, GRAPH_BUCKET_TOKENS - 1), 7)], dim=1)
    with torch.inference_mode():
        got = encoder._last_hidden({"input_ids": padded})[0, PROMPT_TEMPLATE_DROP : ids.shape[1]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_texts_of_different_lengths_get_a_mask_like_diffusers(split_runners, reference_pipeline) -> None:
    encoder = split_runners(torch.float32)[0]
    embeds, mask = encoder.encode_texts([SHORT, LONG], max_sequence_length=512)
    assert mask is not None and mask.dtype == torch.int64
    assert mask[1].all() and not mask[0].all()
    assert torch.equal(embeds[0][mask[0] == 0], torch.zeros_like(embeds[0][mask[0] == 0]))
    ref_embeds, ref_mask = reference_pipeline(torch.float32).encode_prompt(
        [SHORT, LONG], device=torch.device("cpu"), max_sequence_length=512
    )
    assert torch.equal(embeds, ref_embeds) and torch.equal(mask, ref_mask)


def test_max_sequence_length_truncates(split_runners) -> None:
    encoder = split_runners(torch.float32)[0]
    request = GenerationRequest(prompt=LONG, max_sequence_length=3)
    assert encoder.encode([request])[0].tensors["prompt_embeds"].shape[1] == 3


def test_denoiser_reads_the_vae_scale_factor(split_runners) -> None:
    assert split_runners(torch.float32)[1].vae_scale_factor == 4


def test_batch_key_and_finish(split_runners) -> None:
    encoder, denoiser, _ = split_runners(torch.float32)
    request = GenerationRequest(prompt=SHORT, width=64, height=32, num_inference_steps=2)
    state = denoiser.prepare(request, encoder.encode([request])[0])
    # no step cache; no adapters (mixed batching on the CPU: adapters do not split batches)
    assert denoiser.batch_key(state) == (32, 64, False, torch.float32, False, False)
    assert state.total_steps == 2 and not denoiser.is_done(state)
    denoiser.step([state])
    denoiser.step([state])
    assert denoiser.is_done(state)
    result = denoiser.finish(state)
    # 64x32 pixels / (4x VAE * 2x2 patches) = 8 x 4 patches of 4 channels x 4
    assert result.tensors["latents"].shape == (1, 8 * 4, 16)
    assert result.meta == {"height": "32", "width": "64"}


def test_prepare_needs_the_embeddings(split_runners) -> None:
    encoder, denoiser, _ = split_runners(torch.float32)
    plain = GenerationRequest(prompt=SHORT, width=64, height=64)
    with pytest.raises(InvalidArgument):
        denoiser.prepare(plain, StageState(tensors={}))
    cfg = GenerationRequest(prompt=SHORT, negative_prompt=LONG, width=64, height=64)
    with pytest.raises(InvalidArgument, match="negative_prompt_embeds"):
        denoiser.prepare(cfg, encoder.encode([plain])[0])


def test_decoder_rejects_latents_of_the_wrong_size(split_runners) -> None:
    decoder = split_runners(torch.float32)[2]
    state = StageState(tensors={"latents": torch.zeros(1, 5, 16)}, meta={"height": "64", "width": "64"})
    with pytest.raises(InvalidArgument):
        decoder.decode([state])
    with pytest.raises(InvalidArgument):
        decoder.decode([StageState(tensors={"latents": torch.zeros(1, 64, 16)})])


def test_the_decode_timings_take_turns_and_keep_each_ones_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """vae-decode's compile decision times eager and compiled in turns, so that another stage
    busy on the device slows both alike (a cold start's), and keeps each one's fastest run."""
    from omni_common.models.qwenimage import decode

    calls: list[str] = []
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(decode.time, "perf_counter", lambda: next(clock))

    def recorder(name: str):
        def run(latents: torch.Tensor, return_dict: bool) -> None:
            calls.append(name)
            if name == "compiled":
                next(clock)  # each compiled run takes one tick longer on this fake clock

        return run

    best = decode._decode_ms(
        {"eager": recorder("eager"), "compiled": recorder("compiled")}, torch.zeros(1), runs=3
    )
    assert calls == ["eager"] * 2 + ["compiled"] * 2 + ["eager", "compiled"] * 3  # warm-ups, then turns
    assert best == {"eager": 1000.0, "compiled": 2000.0}  # ms: 1 and 2 ticks
