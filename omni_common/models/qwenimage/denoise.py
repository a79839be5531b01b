"""Qwen-Image denoise stage, step-wise: the loop of `QwenImagePipeline.__call__` split into
prepare (noise, timesteps), step (one transformer forward + Euler step) and finish.

The latent size depends on the VAE's compression, 2 ** len(vae.temperal_downsample): 8 for
Qwen-Image, 4 for the tiny fixture. The DiT stage loads no VAE, and diffusers' pipeline
silently assumes 8 without one, so the factor is read from vae/config.json and passed explicitly
(8 when the directory has no vae/).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import (
    QwenImagePipeline,
    calculate_shift,
    retrieve_timesteps,
)
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.utils.torch_utils import randn_tensor

from omni_common.errors import InvalidArgument, Unimplemented
from omni_common.models.base import DenoiserOptions, GenerationRequest, StageState, StepState
from omni_common.models.latent_steps import LatentState, LatentSteps, latent_preview, to_device
from omni_common.models.lora import LoraLayers, RowAdapters
from omni_common.models.qwenimage.execution import BatchInputs, TransformerExecution, forward_inputs
from omni_common.models.qwenimage.graphs import GraphedTransformer
from omni_common.models.qwenimage.lora import read_qwenimage_lora
from omni_common.models.qwenimage.modulation import ModulationCache
from omni_common.models.qwenimage.step_cache import (
    StepCache,
    cached_forward,
    check_cacheable,
    log_reuse,
    step_cache_threshold,
)
from omni_common.models.qwenimage.warmup import WarmUp
from omni_common.models.weights import load_component

DEFAULT_VAE_SCALE_FACTOR = 8


def vae_scale_factor_for(model_dir: Path) -> int:
    """The VAE's spatial compression, from its config only (no weights are loaded)."""
    config_path = model_dir / "vae" / "config.json"
    if not config_path.is_file():
        return DEFAULT_VAE_SCALE_FACTOR
    config = json.loads(config_path.read_text())
    return int(2 ** len(config["temperal_downsample"]))


@dataclass(kw_only=True)
class QwenImageDenoiseState(LatentState):
    """One request in flight: packed latents [1, seq, C*4] and its own scheduler."""

    timesteps: torch.Tensor
    img_shapes: list[list[tuple[int, int, int]]]  # [[(frames, patch rows, patch cols)]]
    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None
    # The "step_cache" option's first-block cache (device tensors); None when it is off.
    step_cache: StepCache | None = None
    # The request's LoRA adapters, held (acquired) until finish or release.
    loras: RowAdapters = ()
    # Packed modulation rows of each step (modulation.py), shared by requests of one
    # schedule; None when the denoiser computes the modulation in the forward.
    modulation: torch.Tensor | None = None


class QwenImageDenoiser(LatentSteps, TransformerExecution):
    """QwenImageTransformer2DModel with flow-matching Euler and dynamic shift: the dit-denoise
    stage model, and its "denoise" role (a StepRunner)."""

    def __init__(
        self,
        transformer: QwenImageTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        device: torch.device,
        dtype: torch.dtype,
        vae_scale_factor: int = DEFAULT_VAE_SCALE_FACTOR,
    ) -> None:
        if transformer.config["guidance_embeds"]:
            raise Unimplemented("guidance-distilled Qwen-Image models are not supported yet")
        self.transformer = transformer
        self.scheduler_config = scheduler.config  # a fresh scheduler per request: it is stateful
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = vae_scale_factor
        self.graphed: GraphedTransformer | None = None
        self.compiled = False
        self.modulation: ModulationCache | None = None
        self.warm_up: WarmUp | None = None  # what configure() compiled ahead, and what is left
        self._warm_up = None
        # Every linear layer of the DiT takes adapters (what diffusers' Qwen-Image LoRA files
        # name); configure() sets their memory bound, directory and batching.
        self.loras = LoraLayers(transformer, read_qwenimage_lora, device=device, dtype=dtype)
        self.lora_grouped = False
        self.devices = 1  # devices one forward is spread over (DenoiserOptions.devices)
        self.spread = None
        self.runners = {"denoise": self}

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        options: DenoiserOptions | None = None,
    ) -> QwenImageDenoiser:
        """Load transformer/ and the scheduler config of a diffusers Qwen-Image directory."""
        transformer = load_component(QwenImageTransformer2DModel, model_dir / "transformer", device, dtype)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler")
        vae_scale_factor = vae_scale_factor_for(model_dir)
        denoiser = cls(transformer, scheduler, device, dtype, vae_scale_factor)
        if options is not None:
            denoiser.configure(options)
        return denoiser

    def prepare(self, request: GenerationRequest, inputs: StageState) -> QwenImageDenoiseState:
        """Initial noise exactly as the pipeline draws it, timesteps, a fresh scheduler."""
        # Nothing here waits for the device: the steps of the running batch go on meanwhile.
        embeds = {k: to_device(v, self.device) for k, v in inputs.tensors.items()}
        if "prompt_embeds" not in embeds:
            raise InvalidArgument("denoise input lacks the tensor 'prompt_embeds'")
        if request.do_true_cfg and "negative_prompt_embeds" not in embeds:
            raise InvalidArgument("true CFG needs the tensor 'negative_prompt_embeds'")
        channels = self.transformer.config["in_channels"] // 4
        height = 2 * (request.height // (self.vae_scale_factor * 2))
        width = 2 * (request.width // (self.vae_scale_factor * 2))
        # The pipeline's generator is a CPU one: noise is drawn on the CPU, then moved.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        cpu = torch.device("cpu")
        noise = randn_tensor(
            (1, 1, channels, height, width), generator=generator, device=cpu, dtype=self.dtype
        )
        noise = to_device(noise, self.device)
        latents = QwenImagePipeline._pack_latents(noise, 1, channels, height, width)
        img_shapes = [[self.img_shape(request.width, request.height)]]

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        steps = request.num_inference_steps
        if steps < 2 and scheduler.config.get("shift_terminal"):
            # One sigma of 1.0 makes the terminal stretch divide by zero: diffusers returns NaN.
            raise InvalidArgument(
                "num_inference_steps is 1; this model's scheduler (shift_terminal) needs at least 2"
            )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        # Made on the CPU, as the pipeline makes them before it moves them (the same values).
        retrieve_timesteps(scheduler, steps, cpu, sigmas=sigmas, mu=mu)  # type: ignore[arg-type]
        scheduler.sigmas = to_device(scheduler.sigmas, self.device)
        timesteps = scheduler.timesteps = to_device(scheduler.timesteps, self.device)
        scheduler.set_begin_index(0)
        threshold = step_cache_threshold(request)
        if threshold > 0:
            if self.devices > 1:  # the cached forward runs the blocks outside the DiT's hooks
                raise Unimplemented(
                    f"step_cache is not available on a replica spread over {self.devices} devices; "
                    "send it to a one-device replica or leave the option out"
                )
            check_cacheable(self.transformer)
            if request.loras:
                raise InvalidArgument("the step_cache option does not combine with LoRA adapters yet")
        modulation = None
        if self.modulation is not None:
            modulation = self.modulation.table((steps, float(mu)), timesteps, self.dtype)
        # Last: nothing after it may fail, or the adapters would stay held.
        loras = self.loras.acquire(request.loras) if request.loras else ()
        return QwenImageDenoiseState(
            request=request,
            step_index=0,
            total_steps=len(timesteps),
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            prompt_embeds=embeds["prompt_embeds"],
            prompt_embeds_mask=embeds.get("prompt_embeds_mask"),
            negative_prompt_embeds=embeds.get("negative_prompt_embeds"),
            negative_prompt_embeds_mask=embeds.get("negative_prompt_embeds_mask"),
            img_shapes=img_shapes,
            step_cache=StepCache(threshold) if threshold > 0 else None,
            loras=loras,
            modulation=modulation,
        )

    def batch_key(self, state: StepState) -> Hashable:
        request = state.request
        # Cached steps run block 0 apart from the rest: they never batch with uncached ones
        # (which replay the whole forward's CUDA graphs); thresholds may differ within a batch,
        # the decision is per request.
        cached = step_cache_threshold(request) > 0
        return (
            request.height,
            request.width,
            request.do_true_cfg,
            self.dtype,
            cached,
            self._lora_key(request),
        )

    def _lora_key(self, request: GenerationRequest) -> Hashable:
        """Grouped: one forward per adapter set. Mixed: adapters of any set share a forward, and
        requests without any join them on the CPU; on a GPU they keep to their own batches,
        which replay CUDA graphs (a forward with adapters runs eagerly)."""
        if self.lora_grouped:
            return request.loras
        return bool(request.loras) and self.device.type == "cuda"

    def step_cost(self, state: StepState) -> int:
        """Transformer image tokens of one step: (H/16)(W/16), doubled by CFG."""
        request = state.request
        return (request.width // 16) * (request.height // 16) * (2 if request.do_true_cfg else 1)

    def release(self, state: StepState) -> None:
        """Drop the state's step cache (latent-sized device tensors) now rather than whenever
        the state itself goes; nothing else is held outside the state."""
        assert isinstance(state, QwenImageDenoiseState)
        if state.step_cache is not None:
            state.step_cache.drop()
        self._release_loras(state)

    def _release_loras(self, state: QwenImageDenoiseState) -> None:
        held, state.loras = state.loras, ()
        self.loras.release(held)

    def step(self, states: Sequence[StepState]) -> None:
        """Advance each state by one step, all of them in one transformer forward.

        The states must share a batch key; they may differ in prompt, prompt length, seed, step
        count and step index. A lone state takes the pipeline's own path (bitwise diffusers);
        several are batched, which equals their lone runs up to float rounding. States with
        the step cache on (a batch key) go through step_cache.cached_forward, alone or not.
        """
        batch = [self._checked(state) for state in states]
        if len({self.batch_key(state) for state in batch}) > 1:
            raise ValueError("step() got states of different batch keys; group them by batch_key()")
        if len({id(state) for state in batch}) != len(batch):
            raise ValueError("step() got the same state twice")
        if not batch:
            return
        # Rows of the forward: each state's, doubled with CFG when batched (cond, then uncond);
        # a lone state's two CFG passes are forwards of one row each.
        rows = [state.loras for state in batch]
        if batch[0].request.do_true_cfg and (len(batch) > 1 or batch[0].step_cache is not None):
            rows = rows + rows
        with self.loras.rows(rows), self._eager_with_adapters():
            if batch[0].step_cache is not None:
                self._step_cached(batch)
            elif len(batch) == 1:
                self._step_one(batch[0])
            else:
                self._step_batch(batch)

    def _checked(self, state: StepState) -> QwenImageDenoiseState:
        if not isinstance(state, QwenImageDenoiseState):
            raise ValueError(f"step() needs QwenImageDenoiseState, got {type(state).__name__}")
        if self.is_done(state):
            raise ValueError("step() got a state that has already finished")
        return state

    @torch.inference_mode()
    def _step_one(self, state: QwenImageDenoiseState) -> None:
        """One request, exactly the pipeline's loop body: with CFG, two forwards."""
        latents = state.latents
        t = state.timesteps[state.step_index]
        timestep = t.expand(latents.shape[0]).to(latents.dtype)  # rounded in the model dtype
        modulation = None
        if state.modulation is not None:
            modulation = state.modulation[state.step_index : state.step_index + 1]

        def cond() -> torch.Tensor:
            embeds, mask = state.prompt_embeds, state.prompt_embeds_mask
            return self._forward(latents, timestep, embeds, mask, state.img_shapes, modulation)

        if state.request.do_true_cfg:
            negative = state.negative_prompt_embeds
            assert negative is not None
            noise_pred, neg_noise_pred = self.branches(
                cond,
                lambda: self._forward(
                    latents,
                    timestep,
                    negative,
                    state.negative_prompt_embeds_mask,
                    state.img_shapes,
                    modulation,
                ),
            )
            noise_pred = guide(noise_pred, neg_noise_pred, state.request.true_cfg_scale)
        else:
            noise_pred = cond()
        self._scheduler_step(state, noise_pred, t)

    @torch.inference_mode()
    def _step_batch(self, states: list[QwenImageDenoiseState]) -> None:
        """Several requests in one forward: per-sample timesteps and right-padded prompts with
        a mask; with CFG the batch is doubled (all conditional, then all unconditional), or,
        when the CFG branches run on different devices, each branch is a forward of its own."""
        if states[0].request.do_true_cfg and self.cfg_branches is not None:
            cond, uncond = self._batch_inputs(states, "cond"), self._batch_inputs(states, "uncond")
            preds = self.branches(lambda: self._forward_batch(cond), lambda: self._forward_batch(uncond))
            noise_preds = torch.cat(preds)
            self._batch_steps(states, noise_preds, cond.ts)
            return
        batch = self._batch_inputs(states)
        self._batch_steps(states, self._forward_batch(batch), batch.ts)

    @torch.inference_mode()
    def _step_cached(self, states: list[QwenImageDenoiseState]) -> None:
        """_step_batch's forward with each request's first-block cache, for one state too.
        Every request computes its last step: nothing after it would correct a reused tail's
        error, and that step's prediction is the final image's last detail."""
        batch = self._batch_inputs(states)
        embeds = batch.embeds.to(self.dtype)
        inputs = forward_inputs(batch.latents, batch.timestep, embeds, batch.mask, batch.modulation)
        caches = [state.step_cache for state in states if state.step_cache is not None]
        if len(caches) != len(states):
            raise ValueError("step() got states with and without a step cache")  # the batch key differs
        last = [state.step_index == state.total_steps - 1 for state in states]
        noise_preds = cached_forward(self.transformer, inputs, batch.img_shapes, caches, last, self.graphed)
        self._batch_steps(states, noise_preds, batch.ts)

    def _batch_inputs(self, states: list[QwenImageDenoiseState], branch: str = "both") -> BatchInputs:
        """The rows of one forward: with CFG ("both") the conditional then the unconditional
        ones; "cond" or "uncond" for one branch alone."""
        latents = torch.cat([state.latents for state in states])
        ts = [state.timesteps[state.step_index] for state in states]
        timestep = torch.stack(ts).to(latents.dtype)  # each rounded in the model dtype, as alone
        img_shapes = [shape for state in states for shape in state.img_shapes]
        tables = [state.modulation for state in states]
        modulation = None
        if all(table is not None for table in tables):
            modulation = torch.cat(
                [
                    table[state.step_index : state.step_index + 1]
                    for table, state in zip(tables, states, strict=True)
                    if table is not None
                ]
            )
        texts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if branch != "uncond":
            texts = [(state.prompt_embeds, state.prompt_embeds_mask) for state in states]
        cfg = states[0].request.do_true_cfg  # part of the batch key: equal for all
        if cfg and branch != "cond":
            for state in states:
                assert state.negative_prompt_embeds is not None
                texts.append((state.negative_prompt_embeds, state.negative_prompt_embeds_mask))
        if cfg and branch == "both":
            latents = torch.cat([latents, latents])
            timestep = torch.cat([timestep, timestep])
            img_shapes = img_shapes + img_shapes
            modulation = None if modulation is None else torch.cat([modulation, modulation])
        embeds, mask = pad_prompts(texts, self.dtype)
        return BatchInputs(latents, timestep, embeds, mask, img_shapes, ts, modulation)

    def _batch_steps(
        self, states: list[QwenImageDenoiseState], noise_preds: torch.Tensor, ts: list[torch.Tensor]
    ) -> None:
        """Each state's rows of a batched prediction, guided with CFG, then its Euler step."""
        cfg = states[0].request.do_true_cfg
        for i, (state, t) in enumerate(zip(states, ts, strict=True)):
            noise_pred = noise_preds[i : i + 1]
            if cfg:
                neg = noise_preds[len(states) + i : len(states) + i + 1]
                noise_pred = guide(noise_pred, neg, state.request.true_cfg_scale)
            self._scheduler_step(state, noise_pred, t)

    @staticmethod
    def _scheduler_step(state: QwenImageDenoiseState, noise_pred: torch.Tensor, t: torch.Tensor) -> None:
        step = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)  # type: ignore[arg-type]
        state.latents = step[0]
        state.step_index += 1

    def preview(self, state: StepState) -> np.ndarray:
        """The current latents as a small picture: unpacked to [C, h, w], the first three
        latent channels mapped to RGB, each stretched to 0..255. Cheap; no VAE."""
        assert isinstance(state, QwenImageDenoiseState)
        request = state.request
        latents = QwenImagePipeline._unpack_latents(
            state.latents.float().cpu(), request.height, request.width, self.vae_scale_factor
        )
        return latent_preview(latents[0, :, 0])

    def finish(self, state: StepState) -> StageState:
        """{"latents": packed [1, seq, C*4]} with meta "height"/"width" in pixels."""
        assert isinstance(state, QwenImageDenoiseState)
        request = state.request
        if state.step_cache is not None:
            log_reuse(state.step_cache, request)
            state.step_cache.drop()
        self._release_loras(state)
        return StageState(
            tensors={"latents": state.latents},
            meta={"height": str(request.height), "width": str(request.width)},
        )


def guide(noise_pred: torch.Tensor, neg_noise_pred: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG, then rescale the guided prediction to the norm of the conditional one."""
    comb_pred = neg_noise_pred + scale * (noise_pred - neg_noise_pred)
    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
    return comb_pred * (cond_norm / noise_norm)


def pad_prompts(
    texts: Sequence[tuple[torch.Tensor, torch.Tensor | None]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings [1, L_i, D] (each with its mask or None) right-padded with zeros to
    [N, max L_i, D], and the int64 mask [N, max L_i] (1 valid, 0 pad), None when every text
    is unpadded and unmasked.

    Padding is safe for QwenImageTransformer2DModel (diffusers 0.42): the mask becomes the
    joint attention's key mask, so padded tokens reach no valid token; text RoPE positions run
    0..L-1 for every sample, so a valid token keeps the position it has alone; everything else
    on the text stream is per token.
    """
    length = max(embeds.shape[1] for embeds, _ in texts)
    needs_mask = any(mask is not None or embeds.shape[1] != length for embeds, mask in texts)
    padded, masks = [], []
    for embeds, mask in texts:
        pad = length - embeds.shape[1]
        padded.append(torch.nn.functional.pad(embeds.to(dtype), (0, 0, 0, pad)))
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        masks.append(torch.nn.functional.pad(mask.to(torch.long), (0, pad)))
    return torch.cat(padded), (torch.cat(masks) if needs_mask else None)
