"""GLM-Image prior role: the AR model samples the image's prior tokens, one token per step, with
requests continuously batched between steps.

Reads like `GlmImagePipeline.generate_prior_tokens` of diffusers 0.42.1 for one prompt: chat
messages (condition images, then the prompt) -> processor inputs -> generation parameters ->
the condition images' tokens (edit mode) -> sampling -> the target image's tokens, upsampled 2x
to the DiT's grid. Sampling is `vision_language_encoder.generate(do_sample=True)` split into a
prefill (`prepare`) and decode steps (`step`), with two differences that change no token:
- each request samples from its own generator seeded with its seed, where the pipeline seeds
  the global RNG (the same stream on the CPU), so its tokens do not depend on its batch mates;
- decode steps batch requests through a slot KV cache (kv_slots.py) and pass each row's 3-D
  mrope positions explicitly: the model keeps the positions of its one `generate` on itself.

A request stepping alone runs `generate`'s very computation, so its tokens are bitwise those of
`generate`. In a batch its attention is still computed alone (kv_slots.py says why); only the
matrix products see the batch. In bfloat16 those were batch-invariant where measured (CPU; H100
for up to 8 rows), so a request samples its lone tokens in any batch. In float32 a product over
several rows takes another kernel than over one (logits differ by <= 2e-7), which could change a
token only where a draw falls that close to a probability boundary: the tests find none.

In edit mode the condition tokens are computed as the model's own forward computes them
(diffusers 0.42.1 passes the concatenated features to `get_image_tokens`, which transformers 5
no longer accepts), and the prefill uses those same features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, GlmImageForConditionalGeneration, GlmImageProcessor

from omni_common.errors import OmniError
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.generation import GenerationState, SlotGenerator, decode_mode
from omni_common.models.glm_image.prior_inputs import (
    condition_images,
    eos_ids,
    generation_params,
    processor_inputs,
    rope_positions,
)
from omni_common.models.kv_slots import cache_keyword
from omni_common.models.sampling import Sampling
from omni_common.models.weights import load_component

MAX_SLOTS = 8  # requests in flight (the step scheduler's default batch)
# Per request: the largest image (2048x2048: 4,096 + 256 preview tokens) plus its prompt.
MAX_TOKENS = 8192
# The graphed decode reserves every slot's KV up front (40 KiB a token at real size): 64 slots
# x 5,120 tokens is 12.5 GiB on the GPU (a 2048x2048 prior and a prompt of up to ~760 tokens).
GRAPHED_MAX_TOKENS = 5120


@dataclass(kw_only=True, eq=False)
class PriorState(GenerationState):
    """One request in flight. `step_index` counts the tokens sampled, of `total_steps`."""

    decode_positions: torch.Tensor  # [3, total_steps] mrope positions of the sampled tokens
    target_offset: int  # where the target image's tokens start among the sampled ones
    target_grid: tuple[int, int]  # (rows, columns) of AR tokens
    condition_ids: torch.Tensor | None = None  # edit mode: [M], upsampled, all images in order
    condition_grids: torch.Tensor | None = None  # edit mode: [images, 3], upsampled

    @property
    def sampled(self) -> torch.Tensor:
        return self.generated


class GlmImagePrior(SlotGenerator):
    """GlmImageForConditionalGeneration sampling prior tokens: the "prior" role (a StepRunner).
    Call `release` for a request that leaves without `finish` (it holds a KV slot)."""

    def __init__(
        self,
        model: GlmImageForConditionalGeneration,
        processor: GlmImageProcessor,
        device: torch.device,
        dtype: torch.dtype,
        *,
        max_slots: int = MAX_SLOTS,
        max_tokens: int = MAX_TOKENS,
        decode: str = "auto",
    ) -> None:
        super().__init__(
            model.model.language_model, device, dtype, max_slots, max_tokens, decode=decode, model=model
        )
        self.model = model
        self.processor = processor
        # Every request's setting (do_sample, the model's own warpers): recorded while idle.
        self.expect_sampling(self._sampling(torch.zeros(1, 1, dtype=torch.long, device=device), 1, 0))

    def _sampling(self, input_ids: torch.Tensor, total: int, seed: int) -> Sampling:
        return Sampling.build(self.model, input_ids, total, seed, do_sample=True)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        max_slots: int = MAX_SLOTS,
        max_tokens: int | None = None,
        decode: str = "auto",
    ) -> GlmImagePrior:
        """Load processor/ and vision_language_encoder/ of a diffusers GLM-Image directory."""
        processor = GlmImageProcessor.from_pretrained(model_dir / "processor")
        model = load_component(
            GlmImageForConditionalGeneration, model_dir / "vision_language_encoder", device, dtype
        )
        if max_tokens is None:
            max_tokens = GRAPHED_MAX_TOKENS if decode_mode(decode, device) == "graphs" else MAX_TOKENS
        return cls(model, processor, device, dtype, max_slots=max_slots, max_tokens=max_tokens, decode=decode)

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, inputs: StageState) -> PriorState:
        """The processor inputs, the condition tokens (edit mode) and the prefill, which samples
        the first token."""
        images = condition_images(request, inputs)
        batch = processor_inputs(self.processor, request, images, self.device)
        grids = batch["image_grid_thw"]
        total, target_offset, target_grid = generation_params(grids, edit=bool(images))
        input_ids = batch["input_ids"]
        prompt_length = input_ids.shape[1]
        positions, decode_positions = rope_positions(
            self.model, input_ids, grids, batch.get("images_per_sample")
        )
        slot = self.slots.acquire(prompt_length + total)
        try:
            state = PriorState(
                request=request,
                step_index=0,
                total_steps=total,
                slot=slot,
                sampling=self._sampling(input_ids, total, request.seed),
                eos=frozenset(eos_ids(self.model)),
                sequence=torch.cat([input_ids, input_ids.new_zeros(1, total)], dim=1),
                prompt_length=prompt_length,
                decode_positions=decode_positions,
                target_offset=target_offset,
                target_grid=target_grid,
            )
            self.check_graphable(state.sampling)
            features = None
            if images:
                source_grids = grids[: len(images)]
                features = self.model.get_image_features(batch["pixel_values"], source_grids)
                tokens = self.model.get_image_tokens(features.pooler_output, source_grids)
                state.condition_ids, state.condition_grids = upsample_conditions(tokens, source_grids)
            self.prefill(state, input_ids, positions, features)
        except BaseException:
            self.slots.release(slot)
            raise
        return state

    def prefill(
        self, state: PriorState, input_ids: torch.Tensor, positions: torch.Tensor, features: Any
    ) -> None:
        """`generate`'s first forward (with a dynamic cache as its own, then copied into the
        state's slot) and the first token. `features`: the condition images' (edit mode)."""
        cache = DynamicCache(config=self.model.config)
        output = self.model(
            input_ids=input_ids,
            position_ids=positions,
            mm_encoder_outputs={"image": features} if features is not None else None,
            **{cache_keyword(self.model): cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self.fill_slot(state, cache)
        self.pick([state], output.logits)
        self.join(state, state.decode_positions)

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        """One decode forward for every state not done, then a token each."""
        live = [s for s in self.live(states) if isinstance(s, PriorState)]
        if self.graphed is not None:
            self.graphed_step(live)
            return
        if not live:
            return
        cache = self.slots.batch([state.slot for state in live])
        tokens = torch.stack(
            [state.sequence[:, state.prompt_length + state.step_index - 1] for state in live]
        )
        # Row i's mrope positions [3, 1] of the token it feeds back (its (step_index - 1)-th).
        positions = torch.stack([s.decode_positions[:, s.step_index - 1 : s.step_index] for s in live], dim=1)
        output = self.model(
            input_ids=tokens,
            position_ids=positions,
            **{cache_keyword(self.model): cache},
            use_cache=True,
            logits_to_keep=1,
            **cache.attention_kwargs,
        )
        self.pick(live, output.logits)
        cache.advance()

    def finish(self, state: StepState) -> StageState:
        """{"prior_token_ids": [1, 4hw]} (the target's tokens, upsampled 2x), in edit mode with
        "prior_token_image_ids" [M] and "source_image_grid_thw" [images, 3]; meta "tokens"."""
        assert isinstance(state, PriorState)
        try:
            rows, columns = state.target_grid
            target = state.sampled[state.target_offset : state.target_offset + rows * columns]
            if target.numel() != rows * columns:
                raise OmniError(
                    f"the AR model ended the image after {state.step_index} of {state.total_steps} tokens"
                )
            tensors = {"prior_token_ids": upsample_2x(target, rows, columns).view(1, -1)}
            if state.condition_ids is not None and state.condition_grids is not None:
                tensors["prior_token_image_ids"] = state.condition_ids
                tensors["source_image_grid_thw"] = state.condition_grids
            return StageState(tensors=tensors, meta={"tokens": str(state.step_index)})
        finally:
            self.release(state)


def upsample_2x(tokens: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A [rows * columns] token grid -> [rows * 2, columns * 2], each token repeated (nearest)."""
    grid = tokens.view(rows, columns)
    return grid.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)


def upsample_conditions(tokens: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The condition images' tokens (all images, in order) and grids [n, 3], upsampled 2x each."""
    per_image = torch.split(tokens.view(-1), grids.prod(dim=-1).tolist())
    upsampled = [
        upsample_2x(ids, int(h), int(w)).view(-1)
        for ids, (_, h, w) in zip(per_image, grids.tolist(), strict=True)
    ]
    return torch.cat(upsampled), grids * grids.new_tensor([1, 2, 2])
