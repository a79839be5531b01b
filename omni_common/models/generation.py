"""What every continuously batched token generator shares (GLM-Image's prior, Qwen2.5-Omni's
thinker and talker): `generate` split into a prefill and decode steps over a slot KV cache
(kv_slots.py), so requests join and leave between tokens, each attending only to its own tokens
and picking its tokens from its own generator (sampling.py); a request stepping alone runs
`generate`'s very computation. A runner subclasses SlotGenerator with its prefill and step."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from omni_common.errors import InvalidArgument, Unimplemented
from omni_common.models.base import StageState, StepState
from omni_common.models.graphed_attention import attention_for, use_graphed_attention
from omni_common.models.graphed_decode import DecodeIO, GraphedDecode, Launched, decoder_of
from omni_common.models.graphed_extend import GraphedExtend
from omni_common.models.kv_slots import KVSlot, KVSlots, use_slot_attention
from omni_common.models.sampling import Sampling, pick_tokens
from omni_common.stages import DECODE_MODES

MAX_TOKENS = 16384  # per request: prompt + generated tokens a slot holds


def decode_mode(mode: str, device: torch.device) -> str:
    """`mode` (DECODE_MODES) resolved for `device`: "eager" runs per-row SDPA, bitwise
    `generate` for a lone request; "graphs" one recorded step per batch bucket
    (graphed_decode.py; off CUDA the same step runs unrecorded, for tests); "auto" is graphs on
    CUDA, eager elsewhere. ValueError for an unknown mode."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode must be one of {DECODE_MODES}, not {mode!r}")
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    return mode


@dataclass(eq=False)
class Prefill:
    """A prompt's prefill while it runs a chunk per scheduler step (chunked prefill): the cache
    of the tokens computed so far (a transformers DynamicCache, copied into the slot after the
    last chunk), how many tokens that is, and what the runner keeps of each chunk (the thinker's
    talker rows, a reused prefix's first)."""

    cache: Any
    done: int
    kept: list[torch.Tensor] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # prompts are prefilled in this order


@dataclass(kw_only=True, eq=False)
class GenerationState(StepState):
    """One request in flight. `step_index` counts the tokens picked, of `total_steps`."""

    slot: KVSlot
    sampling: Sampling
    eos: frozenset[int]
    sequence: torch.Tensor  # [1, prompt + total_steps] int64: the prompt, then the picked tokens
    prompt_length: int
    # Decode positions are the cached length plus this (mrope after images: negative).
    position_offset: int = 0
    finite: bool = True
    last_token: int = -1  # the latest token, on the host (the end check needs no sync)
    chunks_sent: int = 0
    launched: int = 0  # graphed decode: tokens picked or in flight (step_index trails by <= 1)
    # Its prompt's prefill while it runs a chunk per step; None once the prompt is cached (the
    # state decodes from then on).
    prefill: Prefill | None = None

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
        *,
        decode: str = "auto",
        model: Any = None,
        position_rows: int = 3,
        keep_rows: bool = False,
        attention: str = "flex",
        prefill_chunk_tokens: int = 0,
        extend: bool = False,
        io: DecodeIO | None = None,
    ) -> None:
        """`model`: what the graphed decode runs (its decoder and output head), needed for
        decode "graphs"; `position_rows`: the rows of its rope positions; `keep_rows`: also keep
        each step's last hidden + input embedding (`Launched.extra["rows"]`);
        `prefill_chunk_tokens`: a longer prompt is prefilled this many tokens per step, between
        the decode steps of the others (0: every prompt at once, when it is admitted; a runner
        that chunks reads it); `extend`: with the graphed decode, short text prefills run as
        recorded forwards too (`self.extend`, graphed_extend.py; a runner that uses it); `io`:
        the graphed decode's step input and head where they are not the model's own."""
        # The decoder itself: transformers 5.21+ nests the thinker's under a multimodal wrapper.
        text_model = decoder_of(text_model)
        use_slot_attention(text_model)
        config = text_model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.device = device
        self.dtype = dtype
        if prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be 0 (off) or more, not {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.chunks_prefilled = 0  # prefill chunks run by steps (metrics)
        self.slots = KVSlots(
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim,
            device=device,
            dtype=dtype,
            max_slots=max_slots,
            max_tokens=max_tokens,
        )
        self.decode = decode_mode(decode, device)
        self.graphed: GraphedDecode | None = None
        self.extend: GraphedExtend | None = None
        self.pending: tuple[Launched, list[GenerationState]] | None = None
        # Graphed decode: the sampling settings whose steps idle time records at every bucket
        # (a runner's default, then each setting a request brings).
        self.warm_samplings: dict[Hashable, Sampling] = {}
        if self.decode == "graphs":
            self.slots.reserve()
            use_graphed_attention(text_model)
            self.graphed = GraphedDecode(
                model,
                self.slots,
                position_rows=position_rows,
                max_steps=self.slots.max_tokens,
                keep_rows=keep_rows,
                attention=attention_for(attention, head_dim, device),
                io=io,
            )
            self.extend = GraphedExtend(self.graphed) if extend else None

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

    def check_graphable(self, sampling: Sampling) -> None:
        """INVALID_ARGUMENT for a request the graphed decode cannot pick tokens for."""
        if self.graphed is not None and sampling.graph_key is None:
            raise InvalidArgument(
                "this model's generation settings include a logits processor that reads the tokens "
                "seen (other than a leading repetition penalty), which the graphed decode does not "
                "run: serve it with the eager decode"
            )

    def expect_sampling(self, sampling: Sampling) -> None:
        """Have idle time record the graphed steps of `sampling`'s setting at every batch
        bucket, so a batch that grows into a new bucket replays a step and compiles none."""
        if self.graphed is not None and sampling.graph_key is not None:
            self.warm_samplings.setdefault(sampling.graph_key, sampling)

    def _unrecorded(self) -> list[tuple[int, Callable[[], None]]]:
        """What idle time has left to record, each with its rank among its kind's sizes (the
        decode's buckets and the extend's, taken in turns, the smallest first)."""
        graphed = self.graphed
        if graphed is None or graphed.device.type != "cuda":
            return []  # off CUDA the steps run eagerly: nothing to record
        sizes = graphed.bucket_sizes()
        missing: list[tuple[int, Callable[[], None]]] = [
            (sizes.index(size), partial(graphed.prepare, size, s.graph_key, s.processors, s.do_sample))
            for s in self.warm_samplings.values()
            for size in sizes
            if (size, s.graph_key) not in graphed.graphs
        ]
        if self.extend is not None:
            missing += [
                (rank, partial(self.extend.prepare, size))
                for rank, size in enumerate(self.extend.unrecorded())
            ]
        return missing

    def idle_work(self) -> bool:
        """HasIdleWork: record one expected step or extend not yet recorded, the smallest
        first (at real size a recording compiles for up to a minute; a request waits for one)."""
        missing = self._unrecorded()
        if not missing:
            return False
        min(missing, key=lambda item: item[0])[1]()
        return True

    def idle_work_left(self) -> int:
        return len(self._unrecorded())

    def join(self, state: GenerationState, positions: torch.Tensor | None) -> None:
        """Graphed decode: make the prefilled `state` a row from its last picked token (after
        `pick` took its first; again after a resume restored more); its tokens live on the host
        from here on (the host reads them a step late)."""
        if self.graphed is None:
            return
        last = state.sequence[:, state.prompt_length + state.step_index - 1]
        self.graphed.join(
            state.slot.index,
            last.to(self.device),
            state.slot.length,
            positions,
            state.sampling.generator,
            seen=state.seen if state.sampling.penalty is not None else None,
        )
        state.sequence = state.sequence.cpu()
        state.launched = state.step_index

    def graphed_step(self, live: Sequence[GenerationState]) -> tuple[Launched, list[GenerationState]] | None:
        """Launch one graphed step for `live` (those with tokens left to launch), then read the
        previous step's tokens into its states. Returns the step read and the states it
        advanced (None if no step was read)."""
        assert self.graphed is not None
        previous, self.pending = self.pending, None
        rows = sorted((s for s in live if s.launched < s.total_steps), key=lambda s: s.slot.index)
        if rows:
            sampling = rows[0].sampling
            if any(s.sampling.graph_key != sampling.graph_key for s in rows):
                raise InvalidArgument("one graphed step takes requests of one sampling setting (batch_key)")
            self.expect_sampling(sampling)
            launched = self.graphed.launch(
                [s.slot.index for s in rows], sampling.graph_key, sampling.processors, sampling.do_sample
            )
            for state in rows:
                state.launched += 1
            self.pending = (launched, rows)
        if previous is None:
            return None
        launched, states = previous
        if launched.event is not None:
            launched.event.synchronize()
        tokens = launched.tokens.tolist()
        advanced = []
        for state in states:
            if state.slot.released or self.is_done(state):
                continue  # it left, or ended a step ago: this token is past its end
            advanced.append(state)
            token = tokens[state.slot.index]
            if token < 0:
                state.finite = False
            else:
                state.sequence[0, state.prompt_length + state.step_index] = token
                state.last_token = token
            state.step_index += 1
        return launched, advanced

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
        """The states a decode step advances: prefilled and not done."""
        return [
            s for s in states if isinstance(s, GenerationState) and s.prefill is None and not self.is_done(s)
        ]

    def next_prefill(self, states: Sequence[StepState]) -> GenerationState | None:
        """The state whose prompt's next chunk a step of `states` prefills: of those still
        prefilling, the one whose prefill started first. One chunk a step, so the running
        replies wait for one chunk at most however many long prompts join at once."""
        waiting = [
            (s.prefill.started, i, s)
            for i, s in enumerate(states)
            if isinstance(s, GenerationState) and s.prefill is not None
        ]
        return min(waiting)[2] if waiting else None

    def is_prefilling(self, state: StepState) -> bool:
        """Whether `state`'s prompt is still being prefilled a chunk per step (PrefillsInChunks)."""
        return isinstance(state, GenerationState) and state.prefill is not None

    def prefills_at_once(self, remaining: int) -> bool:
        """Whether a prompt with `remaining` tokens to compute is prefilled in one forward when
        it is admitted, not by the steps, a chunk each: chunking off, or it fits one chunk and no
        other request holds a slot. A short prompt that joins others waits for the next step,
        which prefills it whole (the same forward, later): so a burst of prompts holds the
        running replies up by one chunk a step, not by every prompt of the burst at once."""
        if not self.prefill_chunk_tokens:
            return True
        return remaining <= self.prefill_chunk_tokens and len(self.slots.active) <= 1  # its own

    def prefill_chunks(self) -> int:
        """Prefill chunks run by steps so far (PrefillsInChunks: the stage's metrics)."""
        return self.chunks_prefilled

    def batch_key(self, state: StepState) -> Hashable:
        if self.graphed is not None:  # one recorded step per sampling setting
            assert isinstance(state, GenerationState)
            return (str(self.device), self.dtype, state.sampling.graph_key)
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
        state.prefill = None  # (left mid-prefill: its chunks' cache goes too)
        self.slots.release(state.slot)

    def forget_cuda_graphs(self) -> None:
        if self.graphed is not None:
            self.graphed.graphs.clear()
