"""GLM-Image prior role (omni_common/models/glm_image/prior.py) on the tiny fixture: a request
alone samples bitwise the tokens of diffusers' `generate_prior_tokens` / transformers'
`generate`; continuously batched requests each sample the tokens they sample alone; KV slots
are bounded and freed; bad inputs are INVALID_ARGUMENT."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.pipelines.glm_image.pipeline_glm_image import GlmImagePipeline
from PIL import Image

from omni_common.errors import InvalidArgument, ResourceExhausted
from omni_common.input_media import ImageInput, input_image_name
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.glm_image.prior import GlmImagePrior, PriorState
from omni_common.models.glm_image.reference import load_pipeline, reference_prior

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model's ops are too small to share among threads, and two threads on a busy
    2-core machine wait on each other (a decode step measured 4x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(glm_model: Path) -> Path:
    return glm_model


@pytest.fixture(scope="module")
def prior(model_dir: Path) -> GlmImagePrior:
    return GlmImagePrior.load(model_dir, CPU, torch.float32)


@pytest.fixture(scope="module")
def pipeline(model_dir: Path) -> GlmImagePipeline:
    return load_pipeline(model_dir)


def png(width: int, height: int, seed: int = 0) -> tuple[Image.Image, bytes]:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return image, buffer.getvalue()


def blank_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def edit_request(
    prompt: str, data: bytes, width: int, height: int, seed: int
) -> tuple[GenerationRequest, StageState]:
    image = Image.open(io.BytesIO(data))
    info = ImageInput(image.width, image.height, "PNG", hashlib.sha256(data).hexdigest())
    request = GenerationRequest(prompt=prompt, width=width, height=height, seed=seed, images=(info,))
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return request, StageState({input_image_name(0): tensor})


def run_alone(
    prior: GlmImagePrior, request: GenerationRequest, inputs: StageState | None = None
) -> PriorState:
    """Prepare and step `request` by itself to the end (not finished: the slot is released)."""
    state = prior.prepare(request, inputs or StageState({}))
    while not prior.is_done(state):
        prior.step([state])
    prior.release(state)
    return state


@pytest.mark.parametrize(("width", "height", "seed"), [(64, 64, 0), (96, 64, 7)])
def test_text_to_image_alone_samples_the_pipelines_tokens(
    prior: GlmImagePrior, pipeline: GlmImagePipeline, width: int, height: int, seed: int
) -> None:
    request = GenerationRequest(prompt="a red fox in the snow", width=width, height=height, seed=seed)
    state = prior.prepare(request, StageState({}))
    while not prior.is_done(state):
        prior.step([state])
    sampled = state.sampled.clone()
    output = prior.finish(state)

    expected, image_ids, grids = pipeline.generate_prior_tokens(
        request.prompt, height, width, device=CPU, generator=torch.Generator().manual_seed(seed)
    )
    assert image_ids is None and grids is None
    assert output.tensors["prior_token_ids"].dtype == torch.int64
    assert torch.equal(output.tensors["prior_token_ids"], expected)
    # Every sampled token, not only the target's: the whole of `generate`.
    assert torch.equal(sampled, reference_prior(pipeline, request).sampled)
    assert output.meta == {"tokens": str(len(sampled))}
    assert not prior.slots.active


def test_edit_alone_samples_the_models_tokens(prior: GlmImagePrior, pipeline: GlmImagePipeline) -> None:
    """The reference is the pipeline's recipe with the condition tokens computed per image
    (diffusers 0.42.1's own call crashes with transformers 5) and `generate` for the rest."""
    condition, data = png(64, 64)
    request, inputs = edit_request("make it red", data, 64, 64, seed=5)
    state = prior.prepare(request, inputs)
    while not prior.is_done(state):
        prior.step([state])
    sampled = state.sampled.clone()
    output = prior.finish(state)

    expected = reference_prior(pipeline, request, [condition])
    assert torch.equal(sampled, expected.sampled)
    for name in ("prior_token_ids", "prior_token_image_ids", "source_image_grid_thw"):
        assert torch.equal(output.tensors[name], expected.tensors[name]), name
    assert torch.equal(output.tensors["source_image_grid_thw"], torch.tensor([[1, 4, 4]]))


# (prompt, target width, height, condition image sizes): text-to-image requests sample ~255
# tokens (a 16x16 preview first), edit requests only the target's (rows x columns + 1).
BATCH = (
    ("a cat", 64, 64, ()),
    ("a red fox in the snow under a blue sky", 96, 64, ()),
    ("make it red", 256, 256, ((64, 64),)),
    ("the number 0123", 32, 32, ()),
    ("add a hat", 128, 192, ((96, 64),)),
    ("remove the background", 256, 128, ((32, 32),)),
    ("a shop sign that says 'open'", 128, 64, ()),
    ("put them side by side", 192, 192, ((64, 64), (32, 96))),
)
JOIN_AT = (0, 0, 150, 10, 160, 165, 100, 170)  # the decode step each request joins at; all 8 run at 170-185


def batch_request(index: int) -> tuple[GenerationRequest, StageState]:
    prompt, width, height, conditions = BATCH[index]
    infos, tensors = [], {}
    for number, (image_width, image_height) in enumerate(conditions):
        _, data = png(image_width, image_height, seed=number)
        infos.append(ImageInput(image_width, image_height, "PNG", hashlib.sha256(data).hexdigest()))
        tensors[input_image_name(number)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    request = GenerationRequest(
        prompt=prompt, width=width, height=height, seed=100 + index, images=tuple(infos)
    )
    return request, StageState(tensors)


@pytest.fixture(scope="module")
def tokens_alone(prior: GlmImagePrior) -> list[torch.Tensor]:
    """The tokens each request of BATCH samples alone."""
    return [run_alone(prior, *batch_request(index)).sampled.clone() for index in range(len(BATCH))]


def test_continuous_batching_samples_each_requests_lone_tokens(
    prior: GlmImagePrior, tokens_alone: list[torch.Tensor]
) -> None:
    """Requests of both modes join while others are mid-way and leave as they finish; every
    7th step skips one request (a step over a subset of the slots)."""
    states: dict[int, PriorState] = {}
    outputs: dict[int, StageState] = {}
    active: list[int] = []  # in arrival order
    step = 0
    while len(outputs) < len(BATCH):
        for index, join in enumerate(JOIN_AT):
            if join == step:
                states[index] = prior.prepare(*batch_request(index))
                active.append(index)
        skipped = active[1] if step % 7 == 0 and len(active) > 2 else None
        prior.step([states[i] for i in active if i != skipped])
        for index in [i for i in active if prior.is_done(states[i])]:
            outputs[index] = prior.finish(states[index])
            active.remove(index)
        step += 1
    for index, alone in enumerate(tokens_alone):
        assert torch.equal(states[index].sampled, alone), f"request {index}"
        assert outputs[index].meta["tokens"] == str(len(alone))
    assert not prior.slots.active
    assert prior.slots.rows == 8


def test_a_dropped_request_frees_its_slot(prior: GlmImagePrior, tokens_alone: list[torch.Tensor]) -> None:
    small = GlmImagePrior(prior.model, prior.processor, CPU, torch.float32, max_slots=2)
    a = small.prepare(*batch_request(0))
    b = small.prepare(*batch_request(1))
    with pytest.raises(ResourceExhausted, match="KV slots"):
        small.prepare(*batch_request(2))
    for _ in range(20):
        small.step([a, b])
    small.release(a)  # dropped mid-way
    small.release(a)  # idempotent
    assert small.slots.active == [b.slot]
    c = small.prepare(*batch_request(2))
    assert c.slot.index == 0  # a's row, reused
    while not (small.is_done(b) and small.is_done(c)):
        small.step([b, c])
    assert torch.equal(b.sampled, tokens_alone[1])
    assert torch.equal(c.sampled, tokens_alone[2])
    small.finish(b)
    small.finish(c)
    assert not small.slots.active

    tight = GlmImagePrior(prior.model, prior.processor, CPU, torch.float32, max_tokens=64)
    with pytest.raises(ResourceExhausted, match=r"tokens \(prompt and generated\)"):
        tight.prepare(*batch_request(0))


def test_nan_logits_fail_only_their_request(prior: GlmImagePrior) -> None:
    a = prior.prepare(*batch_request(0))
    b = prior.prepare(*batch_request(3))
    logits = torch.zeros(2, 1, prior.model.lm_head.out_features)
    logits[0, 0, 5] = float("nan")
    prior.pick([a, b], logits)
    assert not prior.is_finite(a) and prior.is_finite(b)
    assert a.step_index == b.step_index == 2
    prior.release(a)
    prior.release(b)
    assert not prior.slots.active


@pytest.mark.parametrize(
    ("data", "size", "message"),
    [
        (b"not an image", (64, 64), "could not be decoded"),
        (blank_png(48, 64), (64, 64), "multiples of 32"),
        (blank_png(32, 160), (64, 64), "cannot take"),  # aspect ratio 5: the processor refuses it
        (blank_png(2112, 1024), (64, 64), "would be resized"),  # over the processor's pixel limit
        (blank_png(64, 64), (100, 64), "multiples of 32"),  # the target size
    ],
)
def test_bad_inputs_are_invalid_arguments(
    prior: GlmImagePrior, data: bytes, size: tuple[int, int], message: str
) -> None:
    info = ImageInput(64, 64, "PNG", hashlib.sha256(data).hexdigest())
    request = GenerationRequest(prompt="make it red", width=size[0], height=size[1], images=(info,))
    inputs = StageState({input_image_name(0): torch.frombuffer(bytearray(data), dtype=torch.uint8)})
    with pytest.raises(InvalidArgument, match=message):
        prior.prepare(request, inputs)
    assert not prior.slots.active


def test_a_missing_input_image_is_an_invalid_argument(prior: GlmImagePrior) -> None:
    request, _ = edit_request("make it red", blank_png(64, 64), 64, 64, seed=0)
    with pytest.raises(InvalidArgument, match="uint8"):
        prior.prepare(request, StageState({}))
    assert not prior.slots.active
