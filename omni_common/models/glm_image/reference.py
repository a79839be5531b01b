"""diffusers' GlmImagePipeline run in one process, as a user would run it: the reference the
split stages are compared with (tests) and the competitor they are measured against
(benchmarks). Nothing here serves requests.

`reference_prior` is the pipeline's `generate_prior_tokens`. In edit mode diffusers 0.42.1's own
call crashes with transformers 5 (it passes the concatenated image features to
`get_image_tokens`), so that mode is spelled out with the same recipe: the condition tokens per
image, then `torch.manual_seed(seed)` and `generate(do_sample=True)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_glm_image import GlmImageTransformer2DModel
from diffusers.pipelines.glm_image.pipeline_glm_image import GlmImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from PIL import Image
from transformers import ByT5Tokenizer, GlmImageForConditionalGeneration, GlmImageProcessor, T5EncoderModel

from omni_common.models.base import GenerationRequest
from omni_common.models.weights import load_component


@dataclass(frozen=True)
class ReferencePrior:
    """What the AR produced for one request: every token it sampled, and the DiT's inputs
    ("prior_token_ids"; in edit mode "prior_token_image_ids" and "source_image_grid_thw")."""

    sampled: torch.Tensor
    tensors: dict[str, torch.Tensor]


def load_pipeline(model_dir: Any, dtype: torch.dtype = torch.float32) -> GlmImagePipeline:
    pipe = GlmImagePipeline.from_pretrained(model_dir, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def monolithic_pipeline(model_dir: Path, device: torch.device, dtype: torch.dtype) -> GlmImagePipeline:
    """The pipeline on `device`, each model built as the stages build it (load_component): a
    random-weights directory gets the stages' seeded weights, so a benchmark's diffusers side
    computes with the cluster's weights."""
    model_dir = Path(model_dir)
    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer.from_pretrained(model_dir / "tokenizer"),
        processor=GlmImageProcessor.from_pretrained(model_dir / "processor"),
        text_encoder=load_component(T5EncoderModel, model_dir / "text_encoder", device, dtype),
        vision_language_encoder=load_component(
            GlmImageForConditionalGeneration, model_dir / "vision_language_encoder", device, dtype
        ),
        vae=load_component(AutoencoderKL, model_dir / "vae", device, dtype),
        transformer=load_component(GlmImageTransformer2DModel, model_dir / "transformer", device, dtype),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def processor_batch(
    pipe: GlmImagePipeline, request: GenerationRequest, images: Sequence[Image.Image]
) -> dict[str, Any]:
    """The AR processor's inputs for one prompt, as the pipeline builds them."""
    content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": request.prompt})
    return pipe.processor.apply_chat_template(
        [[{"role": "user", "content": content}]],
        tokenize=True,
        padding=False,
        target_h=request.height,
        target_w=request.width,
        return_dict=True,
        return_tensors="pt",
    ).to(pipe.vision_language_encoder.device)


@torch.no_grad()
def reference_prior(
    pipe: GlmImagePipeline, request: GenerationRequest, images: Sequence[Image.Image] = ()
) -> ReferencePrior:
    """The prior tokens the pipeline samples for `request` (seeded with its seed)."""
    model = pipe.vision_language_encoder
    batch = processor_batch(pipe, request, images)
    grids = batch["image_grid_thw"]
    total, offset, rows, columns = GlmImagePipeline._compute_generation_params(
        grids, is_text_to_image=not images
    )
    tensors: dict[str, torch.Tensor] = {}
    if images:
        source = grids[: len(images)]
        features = model.get_image_features(batch["pixel_values"], source).pooler_output
        tokens = torch.split(model.get_image_tokens(features, source).view(-1), source.prod(-1).tolist())
        tensors["prior_token_image_ids"] = torch.cat(
            [
                GlmImagePipeline._upsample_token_ids(ids, h, w).view(-1)
                for ids, (_, h, w) in zip(tokens, source.tolist(), strict=True)
            ]
        )
        tensors["source_image_grid_thw"] = source * source.new_tensor([1, 2, 2])
    torch.manual_seed(request.seed)
    sampled = model.generate(**batch, max_new_tokens=total, do_sample=True)[0, batch["input_ids"].shape[1] :]
    target = sampled[offset : offset + rows * columns]
    tensors["prior_token_ids"] = GlmImagePipeline._upsample_token_ids(target, rows, columns)
    return ReferencePrior(sampled, tensors)


@torch.no_grad()
def reference_image(
    pipe: GlmImagePipeline,
    request: GenerationRequest,
    images: Sequence[Image.Image] = (),
    prior: ReferencePrior | None = None,
) -> torch.Tensor:
    """The pipeline's image for `request` (float [3, H, W] in [0, 1]); from `prior`'s tokens
    when given (the AR sampling is the slow part of a test), else sampling them first."""
    prior = prior or reference_prior(pipe, request, images)
    edit: dict[str, Any] = {}
    if images:
        edit = {
            "image": list(images),
            "prior_token_image_ids": [prior.tensors["prior_token_image_ids"]],
            "source_image_grid_thw": [prior.tensors["source_image_grid_thw"]],
        }
    return pipe(
        prompt=request.prompt,
        height=request.height,
        width=request.width,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.true_cfg_scale,
        generator=torch.Generator().manual_seed(request.seed),
        max_sequence_length=request.max_sequence_length,
        output_type="pt",
        prior_token_ids=prior.tensors["prior_token_ids"],
        **edit,
    ).images[0]
