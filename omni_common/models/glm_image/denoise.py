"""GLM-Image denoise stage, step-wise: the loop of `GlmImagePipeline.__call__` (diffusers
0.42.1) split into prepare (noise, timesteps), step (the loop body) and finish.

The DiT is conditioned on the glyph embeddings ("prompt_embeds"), on the AR prior's image
tokens ("prior_token_ids", added to the latent patches) and, in edit mode, on the condition
images' keys and values ("condition_kv.k/v", see condition.py). With CFG (a guidance scale
above 1) a second, unconditional forward takes the empty prompt's glyph embeddings, drops
every prior token and skips the condition keys.

Dtypes follow the pipeline: the noise and the first step's input are in the model dtype, but
the guided prediction is float32, so from the second step on the latents are float32 (the
scheduler returns the prediction's dtype) and are cast to the model dtype per forward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers.models.transformers.transformer_glm_image import (
    GlmImageKVCache,
    GlmImageTransformer2DModel,
)
from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift, retrieve_timesteps
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from omni_common.errors import InvalidArgument
from omni_common.models.base import (
    BatchRunner,
    DenoiserOptions,
    GenerationRequest,
    StageState,
    StepRunner,
    StepState,
)
from omni_common.models.glm_image.condition import (
    GlmImageConditionKv,
    check_token_ids,
    checked_condition_kv,
    read_cache,
)
from omni_common.models.glm_image.vae import vae_scale_factor_for
from omni_common.models.latent_steps import LatentState, LatentSteps, latent_preview
from omni_common.models.weights import load_component


@dataclass(kw_only=True)
class GlmImageDenoiseState(LatentState):
    """One request in flight: latents [1, C, H/8, W/8] and its own (stateful) scheduler."""

    timesteps: torch.Tensor
    prompt_embeds: torch.Tensor  # [1, L, D] in the model dtype
    negative_prompt_embeds: torch.Tensor | None  # [1, L', D] with CFG
    prior_token_ids: torch.Tensor  # [1, image tokens] int64
    target_size: torch.Tensor  # [1, 2] (height, width) in pixels, model dtype
    crop_coords: torch.Tensor  # [1, 2] zeros, model dtype
    condition_k: torch.Tensor | None = None  # [layers, 1, S, heads, head_dim] in edit mode
    condition_v: torch.Tensor | None = None

    @property
    def cfg(self) -> bool:
        return self.negative_prompt_embeds is not None


class GlmImageDenoiser(LatentSteps):
    """GlmImageTransformer2DModel with flow-matching Euler: the dit-denoise stage model, with
    its "denoise" role (this StepRunner) and its "condition-kv" role (a BatchRunner)."""

    def __init__(
        self,
        transformer: GlmImageTransformer2DModel,
        scheduler_config: Any,
        device: torch.device,
        dtype: torch.dtype,
        vae_scale_factor: int,
    ) -> None:
        self.transformer = transformer
        self.scheduler_config = scheduler_config  # a fresh scheduler per request: it is stateful
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = vae_scale_factor
        self.condition_kv = GlmImageConditionKv(transformer, device, dtype, vae_scale_factor)
        self.runners: dict[str, StepRunner | BatchRunner] = {
            "denoise": self,
            "condition-kv": self.condition_kv,
        }

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        options: DenoiserOptions | None = None,
    ) -> GlmImageDenoiser:
        """Load transformer/ and the scheduler config of a diffusers GLM-Image directory."""
        if options is not None:
            check_options(options)
        transformer = load_component(GlmImageTransformer2DModel, model_dir / "transformer", device, dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler")
        denoiser = cls(transformer, scheduler.config, device, dtype, vae_scale_factor_for(model_dir))
        if options is not None:
            denoiser.configure(options)
        return denoiser

    def configure(self, options: DenoiserOptions) -> None:
        """Attention backend and compilation (CUDA graphs are not offered for this family)."""
        check_options(options)
        if options.attention_backend:
            self.transformer.set_attention_backend(options.attention_backend)
        if options.compile:
            self.transformer.compile_repeated_blocks(fullgraph=True)

    def image_tokens(self, request: GenerationRequest) -> int:
        """DiT tokens of the output image: (H/16)(W/16) with an 8x VAE and 2x2 patches."""
        multiple = self.vae_scale_factor * self.transformer.config["patch_size"]
        return (request.height // multiple) * (request.width // multiple)

    def prepare(self, request: GenerationRequest, inputs: StageState) -> GlmImageDenoiseState:
        """Initial noise exactly as the pipeline draws it, timesteps, a fresh scheduler."""
        self._check_size(request)
        cfg = request.true_cfg_scale > 1
        tensors = inputs.tensors
        prompt_embeds = self._glyph(tensors, "prompt_embeds")
        negative = self._glyph(tensors, "negative_prompt_embeds") if cfg else None
        prior_token_ids = self._prior_token_ids(tensors, request)
        condition = checked_condition_kv(tensors, self.transformer.config)
        condition_k = condition_v = None
        if condition is not None:
            condition_k, condition_v = (t.to(device=self.device, dtype=self.dtype) for t in condition)

        channels = self.transformer.config["in_channels"]
        shape = (1, channels, request.height // self.vae_scale_factor, request.width // self.vae_scale_factor)
        # The pipeline's generator is a CPU one: the noise is drawn on the CPU, then moved.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        tokens = self.image_tokens(request)
        timesteps = set_schedule(scheduler, request.num_inference_steps, tokens, self.device)
        scheduler.set_begin_index(0)
        size = [(request.height, request.width)]
        return GlmImageDenoiseState(
            request=request,
            step_index=0,
            total_steps=len(timesteps),
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative,
            prior_token_ids=prior_token_ids,
            target_size=torch.tensor(size, dtype=self.dtype, device=self.device),
            crop_coords=torch.zeros((1, 2), dtype=self.dtype, device=self.device),
            condition_k=condition_k,
            condition_v=condition_v,
        )

    def _check_size(self, request: GenerationRequest) -> None:
        multiple = self.vae_scale_factor * self.transformer.config["patch_size"]
        width, height = request.width, request.height
        if width < multiple or height < multiple or width % multiple or height % multiple:
            raise InvalidArgument(
                f"{request.width}x{request.height}: width and height must be positive multiples of {multiple}"
            )

    def _glyph(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        embeds = tensors.get(name)
        if embeds is None:
            raise InvalidArgument(f"denoise input lacks the tensor {name!r}")
        width = self.transformer.config["text_embed_dim"]
        if embeds.dim() != 3 or embeds.shape[0] != 1 or embeds.shape[2] != width:
            raise InvalidArgument(f"{name} has shape {tuple(embeds.shape)}; expected [1, L, {width}]")
        return embeds.to(device=self.device, dtype=self.dtype)

    def _prior_token_ids(self, tensors: dict[str, torch.Tensor], request: GenerationRequest) -> torch.Tensor:
        ids = tensors.get("prior_token_ids")
        if ids is None:
            raise InvalidArgument("denoise input lacks the tensor 'prior_token_ids'")
        tokens = self.image_tokens(request)
        if ids.shape != (1, tokens) or ids.is_floating_point():
            raise InvalidArgument(
                f"prior_token_ids has shape {tuple(ids.shape)}; a {request.width}x{request.height} image "
                f"needs [1, {tokens}] integer ids"
            )
        check_token_ids(ids, self.transformer.config["prior_vq_quantizer_codebook_size"], "prior_token_ids")
        return ids.to(device=self.device, dtype=torch.long)

    def batch_key(self, state: StepState) -> Hashable:
        """What rows of one forward must share: the image size, CFG, the glyph lengths of both
        branches (unpadded: the model's text mask does not cover condition keys) and the
        condition keys' length (0 without)."""
        assert isinstance(state, GlmImageDenoiseState)
        negative = state.negative_prompt_embeds
        return (
            state.request.height,
            state.request.width,
            state.cfg,
            state.prompt_embeds.shape[1],
            negative.shape[1] if negative is not None else 0,
            state.condition_k.shape[2] if state.condition_k is not None else 0,
            self.dtype,
        )

    def step_cost(self, state: StepState) -> int:
        """DiT image tokens of one step, doubled by CFG (condition keys are not counted)."""
        return self.image_tokens(state.request) * (2 if state.request.true_cfg_scale > 1 else 1)

    @torch.inference_mode()
    def step(self, states: Sequence[StepState]) -> None:
        """Advance each state by one step: the pipeline's loop body, the conditional rows of
        all states in one forward and, with CFG, their unconditional rows in another. One
        state alone is bitwise the pipeline; several equal their lone runs up to rounding."""
        batch = [self._checked(state) for state in states]
        if not batch:
            return
        if len({self.batch_key(state) for state in batch}) > 1:
            raise ValueError("step() got states of different batch keys; group them by batch_key()")
        if len({id(state) for state in batch}) != len(batch):
            raise ValueError("step() got the same state twice")
        ts = [state.timesteps[state.step_index] for state in batch]
        latents = torch.cat([state.latents.to(self.transformer.dtype) for state in batch])
        rows = {
            "hidden_states": latents,
            "prior_token_id": torch.cat([state.prior_token_ids for state in batch]),
            "timestep": torch.stack(ts) - 1,  # the pipeline's `t.expand(batch) - 1`
            "target_size": torch.cat([state.target_size for state in batch]),
            "crop_coords": torch.cat([state.crop_coords for state in batch]),
        }
        cache = None
        if batch[0].condition_k is not None:  # edit mode (in the batch key: all or none)
            cache = read_cache([s.condition_k for s in batch], [s.condition_v for s in batch])  # type: ignore[misc]
        embeds = torch.cat([state.prompt_embeds for state in batch])
        noise_preds = self._forward(rows, embeds, drop_prior=False, cache=cache)
        if batch[0].cfg:
            negatives = torch.cat([state.negative_prompt_embeds for state in batch])  # type: ignore[misc]
            # The pipeline's "skip" mode: the condition keys are left out of this forward.
            uncond = self._forward(rows, negatives, drop_prior=True, cache=None)
            noise_preds = guide(uncond, noise_preds, [state.request.true_cfg_scale for state in batch])
        for index, (state, t) in enumerate(zip(batch, ts, strict=True)):
            noise_pred = noise_preds[index : index + 1]
            state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]  # type: ignore[arg-type]
            state.step_index += 1

    def _checked(self, state: StepState) -> GlmImageDenoiseState:
        if not isinstance(state, GlmImageDenoiseState):
            raise ValueError(f"step() needs GlmImageDenoiseState, got {type(state).__name__}")
        if self.is_done(state):
            raise ValueError("step() got a state that has already finished")
        return state

    def _forward(
        self,
        rows: dict[str, torch.Tensor],
        embeds: torch.Tensor,
        *,
        drop_prior: bool,
        cache: GlmImageKVCache | None,
    ) -> torch.Tensor:
        """One transformer call of the loop; the prediction in float32, as the pipeline takes it."""
        prior = rows["prior_token_id"]
        output = self.transformer(
            encoder_hidden_states=embeds,
            prior_token_drop=torch.full_like(prior, drop_prior, dtype=torch.bool),
            return_dict=False,
            kv_caches=cache,
            **rows,
        )[0]
        return output.float()

    def preview(self, state: StepState) -> np.ndarray:
        """The current latents as a small picture (H/8 x W/8): the first three latent channels
        as RGB, each stretched to 0..255. Cheap; no VAE."""
        assert isinstance(state, GlmImageDenoiseState)
        return latent_preview(state.latents[0])

    def resumed_dtype(self, step_index: int) -> torch.dtype:
        """After a step the latents are float32 (see the module docstring); before, model dtype."""
        return self.dtype if step_index == 0 else torch.float32

    def finish(self, state: StepState) -> StageState:
        """{"latents": [1, C, H/8, W/8]} with meta "height"/"width" in pixels."""
        assert isinstance(state, GlmImageDenoiseState)
        request = state.request
        meta = {"height": str(request.height), "width": str(request.width)}
        output = StageState({"latents": state.latents}, meta)
        self.release(state)
        return output

    def release(self, state: StepState) -> None:
        """Drop the condition keys/values early: at real sizes they are the state's bulk."""
        assert isinstance(state, GlmImageDenoiseState)
        state.condition_k = state.condition_v = None

    def forget_cuda_graphs(self) -> None:
        """Nothing: this family captures no graphs."""


def check_options(options: DenoiserOptions) -> None:
    if options.cuda_graphs:
        raise InvalidArgument("CUDA graphs are not supported for GLM-Image yet; start the stage without them")


def set_schedule(
    scheduler: FlowMatchEulerDiscreteScheduler, steps: int, image_tokens: int, device: torch.device
) -> torch.Tensor:
    """The pipeline's schedule: integer timesteps evenly from num_train_timesteps down
    (exclusive of 1), sigmas = timesteps / num_train_timesteps, shifted by the scheduler with
    GLM-Image's mu (a square-root law in the image tokens)."""
    config = scheduler.config
    train_steps = config["num_train_timesteps"]
    timesteps = np.linspace(train_steps, 1.0, steps + 1)[:-1].astype(np.int64).astype(np.float32)
    sigmas = timesteps / train_steps
    mu = calculate_shift(
        image_tokens,
        config.get("base_image_seq_len", 256),
        config.get("base_shift", 0.25),
        config.get("max_shift", 0.75),
    )
    scheduled, _ = retrieve_timesteps(scheduler, steps, device, timesteps, sigmas, mu=mu)  # type: ignore[arg-type]
    return scheduled


def guide(uncond: torch.Tensor, cond: torch.Tensor, scales: Sequence[float]) -> torch.Tensor:
    """CFG per row: uncond + scale * (cond - uncond), each row with its own scale."""
    rows = [
        uncond[i : i + 1] + scale * (cond[i : i + 1] - uncond[i : i + 1]) for i, scale in enumerate(scales)
    ]
    return torch.cat(rows)
