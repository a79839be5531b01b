"""The split GLM-Image run (glyph -> vae-encode -> condition-kv -> step-wise denoise ->
vae-decode) reproduces diffusers' monolithic GlmImagePipeline bit for bit on the same prior
tokens; batched steps equal lone ones up to rounding; checkpoints resume bitwise; bad inputs
are INVALID_ARGUMENT."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.glm_image.pipeline_glm_image import GlmImagePipeline
from PIL import Image

from omni_common.errors import InvalidArgument
from omni_common.input_media import ImageInput, input_image_name
from omni_common.models.base import DenoiserOptions, GenerationRequest, RoleCall, StageState
from omni_common.models.glm_image.denoise import GlmImageDenoiser, GlmImageDenoiseState
from omni_common.models.glm_image.glyph import GlmImageGlyphEncoder, glyph_texts
from omni_common.models.glm_image.reference import (
    ReferencePrior,
    load_pipeline,
    reference_image,
    reference_prior,
)
from omni_common.models.glm_image.vae import GlmImageVae

CPU = torch.device("cpu")
Runners = tuple[GlmImageGlyphEncoder, GlmImageVae, GlmImageDenoiser]
PROMPT = "a shop sign that says 'open' next to a door"
EDIT_PROMPT = "make it red, add a sign saying 'hat'"


@pytest.fixture(scope="module")
def model_dir(glm_model: Path) -> Path:
    return glm_model


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> GlmImagePipeline:
    return load_pipeline(model_dir)


@pytest.fixture(scope="module")
def runners(model_dir: Path) -> Runners:
    return (
        GlmImageGlyphEncoder.load(model_dir, CPU, torch.float32),
        GlmImageVae.load(model_dir, CPU, torch.float32),
        GlmImageDenoiser.load(model_dir, CPU, torch.float32),
    )


def png(seed: int, width: int = 64, height: int = 64) -> torch.Tensor:
    """A random RGB picture as PNG file bytes, the way input images reach a stage."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def image_input(data: torch.Tensor) -> ImageInput:
    image = Image.open(io.BytesIO(data.numpy().tobytes()))
    return ImageInput(image.width, image.height, "PNG", hashlib.sha256(data.numpy().tobytes()).hexdigest())


def text_prior(pipe: GlmImagePipeline, request: GenerationRequest) -> dict[str, torch.Tensor]:
    """The AR prior of a text-to-image request (~5 s on the tiny model, whose AR samples ~260
    tokens: computed once per prompt, size and seed)."""
    key = (request.prompt, request.width, request.height, request.seed)
    if key not in AR_PRIORS:
        AR_PRIORS[key] = reference_prior(pipe, request).tensors
    return AR_PRIORS[key]


AR_PRIORS: dict[tuple[str, int, int, int], dict[str, torch.Tensor]] = {}


def random_prior(request: GenerationRequest) -> dict[str, torch.Tensor]:
    """Valid prior tokens without the AR, for tests that do not compare with the pipeline."""
    tokens = (request.width // 16) * (request.height // 16)
    generator = torch.Generator().manual_seed(request.seed)
    return {"prior_token_ids": torch.randint(0, 128, (1, tokens), generator=generator)}


def edit_prior(
    pipe: GlmImagePipeline, request: GenerationRequest, image: Image.Image
) -> dict[str, torch.Tensor]:
    return reference_prior(pipe, request, [image]).tensors


def pipeline_image(
    pipe: GlmImagePipeline,
    request: GenerationRequest,
    prior: dict[str, torch.Tensor],
    images: Sequence[Image.Image] = (),
) -> torch.Tensor:
    """diffusers' image for `request` on the given prior tokens (float [3, H, W] in [0, 1])."""
    return reference_image(pipe, request, images, ReferencePrior(torch.empty(0), prior))


def call(request: GenerationRequest, **tensors: torch.Tensor) -> RoleCall:
    return RoleCall(request, StageState(dict(tensors)))


def prepare(
    runners: Runners,
    request: GenerationRequest,
    prior: dict[str, torch.Tensor],
    images: Sequence[torch.Tensor] = (),
) -> GlmImageDenoiseState:
    """The roles before the loop, in plan order: glyph, vae-encode and condition-kv (edit)."""
    glyph, vae, denoiser = runners
    tensors = dict(prior) | glyph.runners["glyph"].run_batch([call(request)])[0].tensors
    if images:
        inputs = {input_image_name(i): data for i, data in enumerate(images)}
        tensors |= vae.runners["vae-encode"].run_batch([call(request, **inputs)])[0].tensors
        kv = denoiser.condition_kv.run_batch([call(request, **tensors)])[0]
        assert kv.meta["condition_tokens"] == str(kv.tensors["condition_kv.k"].shape[2])
        tensors |= kv.tensors
    return denoiser.prepare(request, StageState(tensors))


def denoise(denoiser: GlmImageDenoiser, state: GlmImageDenoiseState) -> torch.Tensor:
    while not denoiser.is_done(state):
        denoiser.step([state])
    return denoiser.finish(state).tensors["latents"]


def decode(runners: Runners, request: GenerationRequest, latents: torch.Tensor) -> torch.Tensor:
    meta = {"height": str(request.height), "width": str(request.width)}
    out = (
        runners[1]
        .runners["vae-decode"]
        .run_batch([RoleCall(request, StageState({"latents": latents}, meta))])[0]
    )
    assert out.meta == meta
    return out.tensors["image"]


@pytest.mark.parametrize("guidance", [1.0, 1.5], ids=["no_cfg", "cfg"])
def test_text_to_image_equals_pipeline_bitwise(guidance: float, pipe, runners) -> None:
    request = GenerationRequest(
        prompt=PROMPT, width=96, height=64, num_inference_steps=3, true_cfg_scale=guidance, seed=7
    )
    prior = text_prior(pipe, request)
    state = prepare(runners, request, prior)
    assert (state.negative_prompt_embeds is not None) == (guidance > 1)
    with torch.no_grad():  # as in __call__: with autograd on, T5 takes another kernel
        reference_embeds, reference_negative = pipe.encode_prompt(
            PROMPT,
            guidance > 1,
            max_sequence_length=request.max_sequence_length,
            device=CPU,
            dtype=torch.float32,
        )
    assert torch.equal(state.prompt_embeds, reference_embeds)
    if guidance > 1:
        assert state.negative_prompt_embeds is not None
        assert torch.equal(state.negative_prompt_embeds, reference_negative)
    image = decode(runners, request, denoise(runners[2], state))
    reference = pipeline_image(pipe, request, prior)
    assert image.dtype == torch.float32 and image.shape == (3, 64, 96)
    assert image.std() > 0
    assert torch.equal(image, reference)


@pytest.fixture
def capture_condition(pipe) -> Iterator[dict[str, Any]]:
    """What the pipeline's transformer sees in edit mode: the condition latents of its write
    forward and, at the first read forward, the keys/values its cache holds (layers stacked)."""
    seen: dict[str, Any] = {}

    def hook(module, args, kwargs) -> None:
        cache = kwargs.get("kv_caches")
        mode = cache.caches[0].mode if cache is not None else None
        if mode == "write":
            seen["condition_latents"] = kwargs["hidden_states"].clone()
        elif mode == "read" and "k" not in seen:
            seen["k"] = torch.stack([layer.k_caches[0] for layer in cache.caches])
            seen["v"] = torch.stack([layer.v_caches[0] for layer in cache.caches])

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    yield seen
    handle.remove()


def test_edit_equals_pipeline_bitwise(pipe, runners, capture_condition) -> None:
    data = png(3)
    request = GenerationRequest(
        prompt=EDIT_PROMPT,
        width=64,
        height=64,
        num_inference_steps=3,
        true_cfg_scale=1.5,
        seed=11,
        images=(image_input(data),),
    )
    picture = Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")
    prior = edit_prior(pipe, request, picture)
    state = prepare(runners, request, prior, images=[data])
    image = decode(runners, request, denoise(runners[2], state))
    reference = pipeline_image(pipe, request, prior, images=[picture])

    latents = runners[1].runners["vae-encode"].run_batch([call(request, **{input_image_name(0): data})])[0]
    assert torch.equal(latents.tensors["condition_latents.0"], capture_condition["condition_latents"])
    kv = runners[2].condition_kv.run_batch([call(request, **prior, **latents.tensors)])[0]
    assert kv.tensors["condition_kv.k"].shape == (2, 1, 16, 2, 8)  # 64x64 -> 4x4 tokens of 2 heads x 8
    assert torch.equal(kv.tensors["condition_kv.k"], capture_condition["k"])
    assert torch.equal(kv.tensors["condition_kv.v"], capture_condition["v"])
    assert image.std() > 0
    assert torch.equal(image, reference)


def test_bfloat16_edit_equals_pipeline_bitwise(model_dir: Path) -> None:
    """The pipeline's dtypes: noise, embeddings, condition latents and keys in the model dtype,
    float32 predictions (so float32 latents from the second step on), a bfloat16 image."""
    dtype = torch.bfloat16
    pipe = load_pipeline(model_dir, dtype)
    runners = (
        GlmImageGlyphEncoder.load(model_dir, CPU, dtype),
        GlmImageVae.load(model_dir, CPU, dtype),
        GlmImageDenoiser.load(model_dir, CPU, dtype),
    )
    data = png(8)
    request = GenerationRequest(
        prompt=EDIT_PROMPT,
        width=64,
        height=64,
        num_inference_steps=3,
        true_cfg_scale=1.5,
        seed=12,
        images=(image_input(data),),
    )
    prior = random_prior(request) | {
        "prior_token_image_ids": torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(1)),
        "source_image_grid_thw": torch.tensor([[1, 4, 4]]),
    }
    state = prepare(runners, request, prior, images=[data])
    assert state.latents.dtype == dtype and state.condition_k is not None and state.condition_k.dtype == dtype
    runners[2].step([state])
    assert state.latents.dtype == torch.float32
    image = decode(runners, request, denoise(runners[2], state))
    picture = Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")
    reference = pipeline_image(pipe, request, prior, images=[picture])
    assert reference.dtype == dtype and image.dtype == torch.float32
    assert torch.equal(image, reference.float())


def lone_latents(
    runners: Runners,
    request: GenerationRequest,
    prior: dict[str, torch.Tensor],
    images: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    return denoise(runners[2], prepare(runners, request, prior, images))


def step_together(denoiser: GlmImageDenoiser, states: list[GlmImageDenoiseState], joins: list[int]) -> None:
    """Step `states` as one batch; state i joins after `joins[i]` batched steps and leaves when done."""
    done = 0
    while not all(denoiser.is_done(s) for s in states):
        batch = [s for s, join in zip(states, joins, strict=True) if join <= done and not denoiser.is_done(s)]
        assert len({denoiser.batch_key(s) for s in batch}) == 1
        denoiser.step(batch)
        done += 1


def test_text_to_image_requests_stepped_together_match_lone_runs(pipe, runners) -> None:
    # Equal glyph lengths ('open' / 'shut' / 'door'), so equal batch keys; the rest differs.
    base = GenerationRequest(prompt=PROMPT, width=64, height=64, num_inference_steps=3, true_cfg_scale=1.5)
    requests = [
        replace(base, seed=1),
        replace(base, prompt="a sign that says 'shut'", seed=2, true_cfg_scale=2.5, num_inference_steps=4),
        replace(base, prompt="a red 'door' in the snow", seed=3, num_inference_steps=2),
    ]
    priors = [random_prior(r) for r in requests]
    alone = [lone_latents(runners, r, p) for r, p in zip(requests, priors, strict=True)]
    denoiser = runners[2]
    states = [prepare(runners, r, p) for r, p in zip(requests, priors, strict=True)]
    step_together(denoiser, states, joins=[0, 1, 0])
    for state, expected in zip(states, alone, strict=True):
        got = denoiser.finish(state).tensors["latents"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        print(f"t2i batched vs lone: max |diff| {float((got - expected).abs().max()):.3g}")


def test_edit_requests_stepped_together_match_lone_runs(pipe, runners) -> None:
    images = [png(5), png(6)]
    requests = [
        GenerationRequest(
            prompt=prompt,
            width=64,
            height=64,
            num_inference_steps=3,
            true_cfg_scale=1.5,
            seed=seed,
            images=(image_input(data),),
        )
        for prompt, seed, data in zip([EDIT_PROMPT, "add a sign saying 'cat'"], [4, 5], images, strict=True)
    ]
    pictures = [Image.open(io.BytesIO(d.numpy().tobytes())).convert("RGB") for d in images]
    priors = [edit_prior(pipe, r, p) for r, p in zip(requests, pictures, strict=True)]
    alone = [lone_latents(runners, r, p, [d]) for r, p, d in zip(requests, priors, images, strict=True)]
    denoiser = runners[2]
    states = [prepare(runners, r, p, [d]) for r, p, d in zip(requests, priors, images, strict=True)]
    step_together(denoiser, states, joins=[0, 0])
    for state, expected in zip(states, alone, strict=True):
        got = denoiser.finish(state).tensors["latents"]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        print(f"edit batched vs lone: max |diff| {float((got - expected).abs().max()):.3g}")


def test_checkpoint_restore_resumes_bitwise(pipe, runners) -> None:
    denoiser = runners[2]
    request = GenerationRequest(
        prompt=PROMPT, width=64, height=64, num_inference_steps=4, true_cfg_scale=1.5, seed=9
    )
    prior = random_prior(request)
    expected = lone_latents(runners, request, prior)
    state = prepare(runners, request, prior)
    denoiser.step([state])
    denoiser.step([state])
    checkpoint = denoiser.checkpoint(state)
    assert checkpoint.meta == {"step_index": "2"}
    resumed = prepare(runners, request, prior)
    denoiser.restore(resumed, checkpoint)
    assert torch.equal(denoise(denoiser, resumed), expected)

    with pytest.raises(InvalidArgument, match="latents"):
        denoiser.restore(
            prepare(runners, request, prior),
            StageState({"latents": torch.zeros(1, 4, 4, 4)}, checkpoint.meta),
        )
    with pytest.raises(InvalidArgument, match="step_index"):
        denoiser.restore(
            prepare(runners, request, prior), StageState(checkpoint.tensors, {"step_index": "5"})
        )


def test_costs_keys_preview_and_finish(pipe, runners) -> None:
    glyph, vae, denoiser = runners
    request = GenerationRequest(prompt=PROMPT, width=96, height=64, num_inference_steps=2, true_cfg_scale=1.5)
    state = prepare(runners, request, random_prior(request))
    assert denoiser.step_cost(state) == 6 * 4 * 2
    assert denoiser.batch_key(state) == (64, 96, True, state.prompt_embeds.shape[1], 1, 0, torch.float32)
    assert denoiser.is_finite(state)
    picture = denoiser.preview(state)
    assert picture.dtype == np.uint8 and picture.shape == (8, 12, 3)
    result = denoiser.finish(state)
    assert result.tensors["latents"].shape == (1, 4, 8, 12)
    assert result.meta == {"height": "64", "width": "96"}
    assert vae.runners["vae-decode"].cost(call(request)) == 96 * 64
    assert glyph.runners["glyph"].cost(call(request)) == 1
    assert glyph_texts("say 'a' and \u201cb\u201d then 'c'") == ["a", "c", "b"]  # the pipeline's order
    assert glyph_texts("no quotes") == [""]


def test_bad_inputs_raise_invalid_argument(pipe, runners, model_dir: Path) -> None:
    glyph, vae, denoiser = runners
    request = GenerationRequest(prompt=PROMPT, width=64, height=64, num_inference_steps=2, true_cfg_scale=1.5)
    prior = random_prior(request)
    embeds = glyph.runners["glyph"].run_batch([call(request)])[0].tensors
    good = dict(prior) | embeds

    def fails(tensors: dict[str, torch.Tensor], match: str, req: GenerationRequest = request) -> None:
        with pytest.raises(InvalidArgument, match=match):
            denoiser.prepare(req, StageState(tensors))

    fails({k: v for k, v in good.items() if k != "prompt_embeds"}, "prompt_embeds")
    fails({k: v for k, v in good.items() if k != "negative_prompt_embeds"}, "negative_prompt_embeds")
    fails(good | {"prior_token_ids": prior["prior_token_ids"][:, :-1]}, "prior_token_ids")
    fails(good | {"prior_token_ids": torch.full_like(prior["prior_token_ids"], 10_000)}, "outside")
    fails(good | {"prompt_embeds": torch.zeros(1, 3, 7)}, "prompt_embeds")
    fails(good, "multiples", replace(request, width=72))
    data = png(1)
    edit = replace(request, images=(image_input(data),))
    kv = torch.zeros(2, 1, 16, 2, 8)
    fails(good | {"condition_kv.k": kv}, "pair")
    fails(good | {"condition_kv.k": kv, "condition_kv.v": kv[:, :, :3]}, "condition")
    fails(good | {"condition_kv.k": kv[:1], "condition_kv.v": kv[:1]}, "condition")

    encoder, condition = vae.runners["vae-encode"], denoiser.condition_kv
    with pytest.raises(InvalidArgument, match="input image 0"):
        encoder.run_batch([call(edit)])
    with pytest.raises(InvalidArgument, match="could not be decoded"):
        encoder.run_batch([call(edit, **{input_image_name(0): torch.zeros(10, dtype=torch.uint8)})])
    latents = encoder.run_batch([call(edit, **{input_image_name(0): data})])[0].tensors
    ids, grid = torch.zeros(16, dtype=torch.long), torch.tensor([[1, 4, 4]])
    with pytest.raises(InvalidArgument, match="prior_token_image_ids"):
        condition.run_batch([call(edit, **latents)])
    with pytest.raises(InvalidArgument, match=r"condition_latents\.0"):
        condition.run_batch([call(request, prior_token_image_ids=ids, source_image_grid_thw=grid)])
    assert condition.cost(call(request, **latents)) == 16
    with pytest.raises(InvalidArgument, match="tokens"):
        condition.run_batch(
            [call(edit, **latents, prior_token_image_ids=ids, source_image_grid_thw=grid * 2)]
        )
    with pytest.raises(InvalidArgument, match="ids"):
        condition.run_batch(
            [call(edit, **latents, prior_token_image_ids=ids[:5], source_image_grid_thw=grid)]
        )

    decoder = vae.runners["vae-decode"]
    meta = {"height": "64", "width": "64"}
    with pytest.raises(InvalidArgument, match="do not fit"):
        decoder.run_batch([RoleCall(request, StageState({"latents": torch.zeros(1, 4, 8, 4)}, meta))])
    with pytest.raises(InvalidArgument, match="meta"):
        decoder.run_batch([RoleCall(request, StageState({"latents": torch.zeros(1, 4, 8, 8)}))])
    with pytest.raises(InvalidArgument, match="CUDA graphs"):
        GlmImageDenoiser.load(model_dir, CPU, torch.float32, DenoiserOptions(cuda_graphs=True))
