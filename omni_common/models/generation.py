"""What every continuously batched token generator shares (GLM-Image's prior, Qwen2.5-Omni's
thinker and talker): `generate` split into a prefill and decode steps over a slot KV cache
(kv_slots.py), so requests join and leave between tokens, each attending only to its own tokens
and picking its tokens from its own generator (sampling.py); a request stepping alone runs
`generate`'s very computation. A runner subclasses SlotGenerator with its prefill and step."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_common.errors import Unimplemented
from omni_common.models.base import StageState, StepState
from omni_common.models.kv_slots import KVSlots, Slot, use_slot_attention
from omni_common.models.sampling import Sampling, pick_tokens

MAX_TOKENS = 16384  # per request: prompt + generated tokens a slot holds


@dataclass(kw_only=True, eq=False)
class GenerationState(StepState):
    """One request in flight. `step_index` counts the tokens picked, of `total_steps`."""

    slot: Slot
    sampling: Sampling
    eos: frozenset[int]
    sequence: torch.Tensor  # [1, prompt + total_steps] int64: the prompt, then the picked tokens
    prompt_length: int
    # Decode positions are the cached length plus this (mrope after images: negative).
    position_offset: int = 0
    finite: bool = True
    last_token: int = -1  # the latest token, on the host (the end check needs no sync)
    chunks_sent: int = 0

    @property
    def seen(self) -> torch.Tensor:
        """The prompt and the tokens picked so far [1, n] (what repetition penalties read)."""
        return self.sequence[:, : self.prompt_length + self.step_index]

    @property
    def generated(self) -> torch.Tensor:
        return self.sequence[0, self.prompt_length : self.prompt_length + self.step_index]


class SlotGenerator:
    """The StepRunner parts of a continuously batched generator; subclasses prefill and step."""

    def __init__(
        self,
        text_model: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        use_slot_attention(text_model)
        config = text_model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.device = device
        self.dtype = dtype
        self.slots = KVSlots(
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim,
            device=device,
            dtype=dtype,
            max_slots=max_slots,
            max_tokens=max_tokens,
        )

    def pick(self, states: Sequence[GenerationState], logits: torch.Tensor) -> None:
        """Pick and record each state's next token from its row of `logits`; a state whose row
        is not finite is marked so (it fails alone)."""
        picked = pick_tokens([(state.sampling, state.seen) for state in states], logits)
        found = [token for token in picked if token is not None]
        values = iter(torch.cat(found).view(-1).tolist() if found else [])  # one sync per step
        for state, token in zip(states, picked, strict=True):
            if token is None:
                state.finite = False
            else:
                state.sequence[:, state.prompt_length + state.step_index] = token[:, 0]
                state.last_token = next(values)
            state.step_index += 1

    def fill_slot(self, state: GenerationState, cache: Any) -> None:
        """Copy a prefill's DynamicCache into the state's slot."""
        layers: list[Any] = list(cache.layers)
        self.slots.fill(state.slot, [layer.keys for layer in layers], [layer.values for layer in layers])

    def positions(self, states: Sequence[GenerationState], rows: int) -> torch.Tensor:
        """Decode positions [rows, batch, 1]: each request's next position (mrope: the sections
        all count tokens past the prompt, from its offset)."""
        lengths = torch.tensor(
            [state.slot.length + state.position_offset for state in states], device=self.device
        )
        return lengths.view(1, -1, 1).expand(rows, -1, -1)

    def live(self, states: Sequence[StepState]) -> list[GenerationState]:
        return [s for s in states if isinstance(s, GenerationState) and not self.is_done(s)]

    def batch_key(self, state: StepState) -> Hashable:
        return (str(self.device), self.dtype)

    def step_cost(self, state: StepState) -> int:
        return 1

    def is_done(self, state: StepState) -> bool:
        assert isinstance(state, GenerationState)
        return state.step_index >= state.total_steps or state.last_token in state.eos

    def is_finite(self, state: StepState) -> bool:
        assert isinstance(state, GenerationState)
        return state.finite

    def preview(self, state: StepState) -> np.ndarray | None:
        return None

    def checkpoint(self, state: StepState) -> StageState | None:
        return None  # a replica that takes over picks the same tokens again from the seed

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        raise Unimplemented("token generators do not resume from checkpoints: they run again from the seed")

    def release(self, state: StepState) -> None:
        """Free the state's KV slot (idempotent)."""
        assert isinstance(state, GenerationState)
        self.slots.release(state.slot)

    def forget_cuda_graphs(self) -> None:
        pass
