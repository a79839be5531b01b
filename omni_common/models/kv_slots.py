"""The KV cache of a continuously batched autoregressive generator (GLM-Image's prior,
Qwen2.5-Omni's thinker and talker): a slot (a row of preallocated buffers) per request in
flight, so decode steps batch requests of different lengths without copying anyone's cache,
and each request's attention computes exactly what it computes alone. Any transformers
decoder whose attention goes through its attention interface can use it.

Per layer, keys and values live in one buffer [rows, kv_heads, capacity, head_dim]; a request
holds a row from its prefill to its finish. A decode forward writes each row's new key/value at
that row's length, and the attention (`slot_attention`) runs SDPA once per row over that row's
own tokens: a view of the buffer, exactly the length the row has, with no mask.

Why per row rather than one masked SDPA over the batch padded to its longest row: a padded,
masked SDPA is a different kernel with another reduction order, not bitwise the lone request's
unmasked one (measured: most rows on an H100, ~5% of bfloat16 rows on the CPU), and in bfloat16
that flips sampled tokens (1 of 8 requests, on both). Matrix products in bfloat16 were
batch-invariant (H100 at 4096x4096 for 1..8 rows; CPU), so with per-row attention a bfloat16
request samples the same tokens in any batch, which seeded restarts elsewhere rely on. Per-row
SDPA also never repeats keys/values for grouped heads (unmasked SDPA takes `enable_gqa`) and
never gathers rows. It costs an SDPA call per row and layer, mostly host time: on an H100 (torch
2.11, bfloat16, GLM-Image's shapes, 8 rows of 1,000-2,500 tokens, 40 layers) 21 ms a step,
against 18 ms for one masked call per layer (transformers repeats K/V 16x for it) and 3 ms
for one unmasked call, the floor a paged/varlen decode kernel would approach.

Memory is bounded by `max_slots` x `max_tokens` and grows on demand: rows double up to
`max_slots`, capacity rounds up to `CAPACITY_STEP` tokens past the longest request so far; it
never shrinks. Growth reallocates (a copy of what is cached) only when a request is admitted,
never during a step; a release copies nothing. At GLM-Image's size (40 layers, 2 KV heads of
128, bfloat16) a token holds 40 KiB: 8 requests of 1024x1024 (~1,300 tokens + prompt) take
~0.5 GiB.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from omni_common.errors import ResourceExhausted

CAPACITY_STEP = 256  # tokens; a 1024x1024 GLM-Image request holds ~1,300 + its prompt
SLOT_ATTENTION = "omnistage_slot_rows"  # the attention implementation's registered name


_CACHE_KEYWORDS: dict[type, str] = {}  # per model class, read once


def cache_keyword(module: torch.nn.Module) -> str:
    """The name under which `module`'s forward takes its KV cache: `cache` from transformers
    5.24 on (where `past_key_values` is deprecated, to go in 5.40), `past_key_values` before."""
    model_class = type(module)
    if model_class not in _CACHE_KEYWORDS:
        parameters = inspect.signature(model_class.forward).parameters
        _CACHE_KEYWORDS[model_class] = "cache" if "cache" in parameters else "past_key_values"
    return _CACHE_KEYWORDS[model_class]


@dataclass(eq=False)
class KVSlot:
    """A request's row in the buffers and how many of its tokens are cached there."""

    index: int
    length: int = 0
    released: bool = False


class KVSlots:
    """Per-layer key/value buffers with a row per request in flight."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int,
        max_tokens: int,
    ) -> None:
        self.shape = (kv_heads, head_dim)
        self.layers = layers
        self.device = device
        self.dtype = dtype
        self.max_slots = max_slots
        self.max_tokens = max_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owners: list[KVSlot | None] = []  # per row
        self._allocate(rows=0, capacity=0)

    @property
    def rows(self) -> int:
        return len(self.owners)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def active(self) -> list[KVSlot]:
        return [slot for slot in self.owners if slot is not None]

    def acquire(self, tokens: int) -> KVSlot:
        """The lowest free row, for a request that will cache `tokens` tokens (prompt + sampled)."""
        if tokens > self.max_tokens:
            raise ResourceExhausted(
                f"the request needs {tokens} tokens (prompt and generated); this generator holds at most "
                f"{self.max_tokens} per request: ask for a shorter output or a shorter prompt"
            )
        free = [row for row, owner in enumerate(self.owners) if owner is None]
        if not free and self.rows >= self.max_slots:
            raise ResourceExhausted(
                f"all {self.max_slots} KV slots of this generator are in use; retry when a request finishes"
            )
        rows = self.rows if free else min(self.max_slots, max(1, 2 * self.rows))
        capacity = max(self.capacity, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)
        if (rows, capacity) != (self.rows, self.capacity):
            self._allocate(rows, capacity)
        slot = KVSlot(free[0] if free else self.owners.index(None))
        self.owners[slot.index] = slot
        return slot

    def reserve(self) -> None:
        """Allocate every row at `max_tokens` now, so the buffers never move again (what CUDA
        graphs that read them need); `acquire` then never reallocates."""
        capacity = -(-self.max_tokens // CAPACITY_STEP) * CAPACITY_STEP
        self.max_tokens = capacity
        self._allocate(self.max_slots, capacity)

    def release(self, slot: KVSlot) -> None:
        """Free `slot`'s row (nothing is copied or cleared: no one reads past a row's length).
        Idempotent."""
        if not slot.released:
            slot.released = True
            self.owners[slot.index] = None

    def fill(self, slot: KVSlot, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Store a prefill's cache (per layer [1, kv_heads, L, head_dim]) in `slot`."""
        length = keys[0].shape[2]
        rows = [buffer[slot.index, :, :length] for buffer in (*self.keys, *self.values)]
        torch._foreach_copy_(rows, [cached[0] for cached in (*keys, *values)])  # one launch, not 2 a layer
        slot.length = length

    def view(
        self, slot: KVSlot, length: int | None = None
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """What `slot` caches (its first `length` tokens: all by default), in place: per layer
        keys and values [1, kv_heads, length, head_dim]."""
        rows, length = slice(slot.index, slot.index + 1), slot.length if length is None else length
        return tuple(k[rows, :, :length] for k in self.keys), tuple(v[rows, :, :length] for v in self.values)

    def read(
        self, slot: KVSlot, length: int | None = None
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Copies of what `slot` caches (`view`'s)."""
        keys, values = self.view(slot, length)
        return tuple(k.clone() for k in keys), tuple(v.clone() for v in values)

    def batch(self, slots: Sequence[KVSlot]) -> SlotBatch:
        """The cache of one decode forward over `slots` (in that row order)."""
        return SlotBatch(self, slots)

    def _allocate(self, rows: int, capacity: int) -> None:
        """(Re)allocate the buffers, keeping what they hold."""
        kv_heads, head_dim = self.shape
        for buffers in (self.keys, self.values):
            for layer in range(self.layers):
                fresh = torch.zeros(rows, kv_heads, capacity, head_dim, device=self.device, dtype=self.dtype)
                if layer < len(buffers):
                    old = buffers[layer]
                    fresh[: old.shape[0], :, : old.shape[2]] = old
                    buffers[layer] = fresh
                else:
                    buffers.append(fresh)
        self.owners += [None] * (rows - len(self.owners))


class SlotLayer(CacheLayerMixin):
    """One attention layer's part of a `SlotBatch`: its buffers are `KVSlots`' (allocated when a
    request is admitted, so there is nothing to initialise lazily)."""

    is_sliding = False

    def __init__(self, batch: SlotBatch, layer_idx: int) -> None:
        super().__init__()
        self.batch = batch
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the rows were allocated when their requests were admitted."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`key_states`/`value_states` [rows, kv_heads, 1, head_dim] written at each row's length;
        the span's keys and values up to the longest row (a view). Extra arguments (transformers
        passes its attention kwargs, or `cache_kwargs` in older releases) are not needed here."""
        batch = self.batch
        keys = batch.slots.keys[self.layer_idx][batch.span]
        values = batch.slots.values[self.layer_idx][batch.span]
        keys[batch.offsets, :, batch.positions] = key_states[:, :, 0]
        values[batch.offsets, :, batch.positions] = value_states[:, :, 0]
        return keys[:, :, : batch.kv_length], values[:, :, : batch.kv_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.batch.kv_length, 0

    def get_seq_length(self) -> int:
        return self.batch.kv_length - 1

    def get_max_length(self) -> int:
        return self.batch.slots.capacity


class SlotBatch(Cache):
    """What the attention layers of one decode forward see as their cache: a transformers `Cache`
    whose layers (`SlotLayer`) write each row's new key/value at that row's length and return the
    buffers' rows [lo, hi) spanning the batch (a view); `attention_kwargs` tells `slot_attention`
    which of those rows and how many tokens each query row attends to. Call `advance` after the
    forward. Sequence lengths, mask sizes and the query offset are the longest row's: with no 4-D
    mask, transformers' `create_causal_mask` sizes its own from them (and, for one query token and
    no padding, makes none: SDPA runs unmasked, as in `generate`)."""

    def __init__(self, slots: KVSlots, rows: Sequence[KVSlot]) -> None:
        assert not any(slot.released for slot in rows), "a released slot cannot step"
        self.slots = slots
        self.rows = list(rows)
        first = min(slot.index for slot in rows)
        self.span = slice(first, max(slot.index for slot in rows) + 1)
        # Per query row: its row within the span and its length once this step's token is in.
        self.row_spans = [(slot.index - first, slot.length + 1) for slot in rows]
        self.offsets = torch.tensor([row for row, _ in self.row_spans], device=slots.device)
        self.positions = torch.tensor([slot.length for slot in rows], device=slots.device)
        self.kv_length = max(length for _, length in self.row_spans)
        super().__init__(layers=[SlotLayer(self, layer) for layer in range(slots.layers)])

    @property
    def attention_kwargs(self) -> dict[str, Any]:
        """The forward's keyword arguments that reach `slot_attention`."""
        return {"slot_rows": self.row_spans}

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.kv_length - 1

    def advance(self) -> None:
        """Count the token each row just cached."""
        for slot in self.rows:
            slot.length += 1


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    slot_rows: Sequence[tuple[int, int]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: with `slot_rows` (a decode step over slots; per query
    row, its row in `key`/`value` and its length), transformers' SDPA once per row on exactly
    that row's tokens, as the request alone runs it; otherwise transformers' SDPA unchanged (a
    prefill, or any other use of the model)."""
    if slot_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = [
        sdpa_attention_forward(
            module,
            query[i : i + 1],
            key[row : row + 1, :, :length],
            value[row : row + 1, :, :length],
            None,
            **kwargs,
        )[0]
        for i, (row, length) in enumerate(slot_rows)
    ]
    return torch.cat(outputs), None


def use_slot_attention(text_model: Any) -> None:
    """Make a transformers decoder (GLM-Image's `model.model.language_model`, a Qwen2.5-Omni
    thinker's or talker's `model`) attend through `slot_attention` (registered process-wide
    under SLOT_ATTENTION, with SDPA's mask rules). Its prefills and any other forward keep
    transformers' SDPA computation; it must be loaded with SDPA."""
    current = text_model.config._attn_implementation
    if current not in ("sdpa", SLOT_ATTENTION):
        raise ValueError(f"slot attention needs a model loaded with SDPA attention, not {current!r}")
    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)
    text_model.set_attn_implementation(SLOT_ATTENTION)
