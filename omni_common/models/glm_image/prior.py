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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import (
    DynamicCache,
    GlmImageForConditionalGeneration,
    GlmImageProcessor,
    LogitsProcessorList,
)

from omni_common.errors import OmniError, Unimplemented
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.glm_image.kv_slots import KVSlots, Slot, use_slot_attention
from omni_common.models.glm_image.prior_inputs import (
    condition_images,
    eos_ids,
    generation_params,
    logits_processors,
    processor_inputs,
    rope_positions,
    row_wise_key,
)
from omni_common.models.weights import load_component

MAX_SLOTS = 8  # requests in flight (the step scheduler's default batch)
# Per request: the largest image (2048x2048: 4,096 + 256 preview tokens) plus its prompt.
MAX_TOKENS = 8192


@dataclass(kw_only=True, eq=False)
class PriorState(StepState):
    """One request in flight. `step_index` counts the tokens sampled, of `total_steps`."""

    slot: Slot
    generator: torch.Generator
    processors: LogitsProcessorList
    sampling_key: Hashable | None  # equal for states whose processors can run as one batch
    eos: frozenset[int]
    sequence: torch.Tensor  # [1, prompt + total_steps] int64: the prompt, then the sampled tokens
    prompt_length: int
    decode_positions: torch.Tensor  # [3, total_steps] mrope positions of the sampled tokens
    target_offset: int  # where the target image's tokens start among the sampled ones
    target_grid: tuple[int, int]  # (rows, columns) of AR tokens
    condition_ids: torch.Tensor | None = None  # edit mode: [M], upsampled, all images in order
    condition_grids: torch.Tensor | None = None  # edit mode: [images, 3], upsampled
    finite: bool = True
    last_token: int = -1  # the latest sampled token, on the host (the end check needs no sync)

    @property
    def sampled(self) -> torch.Tensor:
        return self.sequence[0, self.prompt_length : self.prompt_length + self.step_index]


class GlmImagePrior:
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
    ) -> None:
        use_slot_attention(model)
        self.model = model
        self.processor = processor
        self.device = device
        self.dtype = dtype
        text: Any = model.config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.slots = KVSlots(
            text.num_hidden_layers,
            text.num_key_value_heads,
            head_dim,
            device=device,
            dtype=dtype,
            max_slots=max_slots,
            max_tokens=max_tokens,
        )

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        *,
        max_slots: int = MAX_SLOTS,
        max_tokens: int = MAX_TOKENS,
    ) -> GlmImagePrior:
        """Load processor/ and vision_language_encoder/ of a diffusers GLM-Image directory."""
        processor = GlmImageProcessor.from_pretrained(model_dir / "processor")
        model = load_component(
            GlmImageForConditionalGeneration, model_dir / "vision_language_encoder", device, dtype
        )
        return cls(model, processor, device, dtype, max_slots=max_slots, max_tokens=max_tokens)

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
                generator=torch.Generator(self.device).manual_seed(request.seed),
                processors=(processors := logits_processors(self.model, input_ids, total)),
                sampling_key=row_wise_key(processors),
                eos=frozenset(eos_ids(self.model)),
                sequence=torch.cat([input_ids, input_ids.new_zeros(1, total)], dim=1),
                prompt_length=prompt_length,
                decode_positions=decode_positions,
                target_offset=target_offset,
                target_grid=target_grid,
            )
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
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        layers: list[Any] = list(cache.layers)
        self.slots.fill(state.slot, [layer.keys for layer in layers], [layer.values for layer in layers])
        self.append([state], self.sample([state], output.logits))

    def batch_key(self, state: StepState) -> Hashable:
        return (str(self.device), self.dtype)

    def step_cost(self, state: StepState) -> int:
        return 1

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        """One decode forward for every state not done, then a token each."""
        live = [s for s in states if isinstance(s, PriorState) and not self.is_done(s)]
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
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **cache.attention_kwargs,
        )
        picked = self.sample(live, output.logits)
        cache.advance()
        self.append(live, picked)

    def sample(self, states: Sequence[PriorState], logits: torch.Tensor) -> list[torch.Tensor | None]:
        """The next token [1, 1] of each state from its row of `logits` [rows, 1, vocab], as
        `generate(do_sample=True)` picks it (float32 scores, its logits processors, softmax,
        multinomial), from the state's own generator; None for a row holding NaN or Inf. Changes
        no state but the generators, so a step that fails here can be run again."""
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        finite = torch.isfinite(scores).all(dim=-1).tolist()
        probs = self.probabilities(states, scores)
        return [
            torch.multinomial(probs[row : row + 1], num_samples=1, generator=state.generator) if ok else None
            for row, (state, ok) in enumerate(zip(states, finite, strict=True))
        ]

    def probabilities(self, states: Sequence[PriorState], scores: torch.Tensor) -> torch.Tensor:
        """softmax(processors(scores)) of each row. When every state has the same processors and
        they read nothing but their row's scores (`row_wise_key`), one call covers the batch:
        each row's arithmetic is its own either way, and the step's host time is per call. Other
        processors run per row, over the tokens that row has seen."""
        keys = {state.sampling_key for state in states}
        if len(keys) == 1 and None not in keys:
            processed = scores
            for processor in states[0].processors:
                processed = processor(cast(torch.LongTensor, None), cast(torch.FloatTensor, processed))
            return torch.nn.functional.softmax(processed, dim=-1)
        rows: list[torch.Tensor] = []
        for row, state in enumerate(states):
            seen = state.sequence[:, : state.prompt_length + state.step_index]
            rows.append(
                state.processors(cast(torch.LongTensor, seen), cast(torch.FloatTensor, scores[row : row + 1]))
            )
        return torch.nn.functional.softmax(torch.cat(rows), dim=-1)

    def append(self, states: Sequence[PriorState], picked: Sequence[torch.Tensor | None]) -> None:
        """Record each state's new token; a state without one is no longer finite (and fails)."""
        found = [token for token in picked if token is not None]
        values = iter(torch.cat(found).view(-1).tolist() if found else [])  # one sync per step
        for state, token in zip(states, picked, strict=True):
            if token is None:
                state.finite = False
            else:
                state.sequence[:, state.prompt_length + state.step_index] = token[:, 0]
                state.last_token = next(values)
            state.step_index += 1

    def is_done(self, state: StepState) -> bool:
        assert isinstance(state, PriorState)
        if state.step_index >= state.total_steps:
            return True
        return state.last_token in state.eos

    def is_finite(self, state: StepState) -> bool:
        assert isinstance(state, PriorState)
        return state.finite

    def preview(self, state: StepState) -> np.ndarray | None:
        return None

    def checkpoint(self, state: StepState) -> StageState | None:
        return None  # a replica that takes over samples the same tokens again from the seed

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        raise Unimplemented("the GLM-Image prior does not resume from checkpoints")

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

    def release(self, state: StepState) -> None:
        """Free the state's KV slot (idempotent)."""
        assert isinstance(state, PriorState)
        self.slots.release(state.slot)

    def forget_cuda_graphs(self) -> None:
        pass


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
