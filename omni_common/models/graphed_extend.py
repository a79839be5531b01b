"""A short prefill recorded as a CUDA graph: one request's next tokens (a short text prompt, or
a conversation's new turn after a prefix this replica kept) through the decoder in one forward,
written straight into its KV slot, recorded once per token-count bucket and replayed.

Why: at real size transformers' eager forward of a few dozen tokens costs the host 35-70 ms
(Qwen2.5-Omni's thinker: 69 ms for a 64-token prompt, 47 ms for a reused prefix's new turn)
where reading the weights once takes 5 ms, so a short prefill, not the decode, set the time to
the first token.

What a forward is, on the device only (GraphedDecode's buffers and compiled decoder):
- the request's tokens, padded to the bucket, and their rope positions sit in static buffers
  (a decoder whose prompt is not its tokens' embeddings, Qwen2.5-Omni's talker, takes each
  token's row instead: its DecodeIO.prefill makes the input from it);
- each layer writes the tokens' keys and values into the slot's row at its cached length
  onwards (the padding's land past them, where the decode writes before it reads), and every
  query attends to the row's tokens up to its own position: one masked SDPA over the row;
- the outputs are the last layer's rows and the input embeddings of every token (a talker's
  input) and the float logits of the last real token (its first pick, on the host as before).

Only text: a chunk that holds an audio clip, an image or a video runs the eager prefill, as do
longer chunks than the largest bucket. Off CUDA the same forward runs unrecorded (a reference
the CPU tests compare with the eager prefill).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from omni_common.models.graphed_attention import RowAttention, causal_flex_rows
from omni_common.models.graphed_decode import COMPILE_MODE, GraphedDecode, SlotRowsCache
from omni_common.models.kv_slots import KVSlot, KVSlots

log = logging.getLogger("omnistage.graphed_extend")

EXTEND_BUCKETS = (16, 32, 64, 128, 256)  # token counts a forward is recorded for
MAX_SPLITS = 8  # the most splits of a row's keys one extend's attention reads at once


class ExtendCache(SlotRowsCache):
    """`past_key_values` of an extend: writes the tokens' keys/values into the slot's row from
    its cached length and hands the attention that row (a copy of the slot's buffer)."""

    def __init__(self, slots: KVSlots, slot: torch.Tensor, positions: torch.Tensor) -> None:
        super().__init__(slots)
        self.slot = slot  # [1] the row
        self.positions = positions  # [count] where each token's key goes (clamped to the row)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.slots.keys[layer_idx], self.slots.values[layer_idx]
        where = (self.slot.view(1, 1), slice(None), self.positions.view(1, -1))
        keys[where] = key.transpose(1, 2)  # [1, count, kv_heads, head_dim]
        values[where] = value.transpose(1, 2)
        return keys.index_select(0, self.slot), values.index_select(0, self.slot)


class GraphedExtend:
    """Short prefills against GraphedDecode's slots, a recorded forward per EXTEND_BUCKETS
    size. `run` one; `prepare` records a size ahead (idle time)."""

    def __init__(self, decode: GraphedDecode) -> None:
        self.decode = decode
        self.slots = decode.slots
        self.device = decode.device
        largest = EXTEND_BUCKETS[-1]
        self.ids = torch.zeros(largest, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(decode.position_rows, largest, dtype=torch.long, device=self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self.start = torch.zeros(1, dtype=torch.long, device=self.device)  # tokens cached before
        self.last = torch.zeros(1, dtype=torch.long, device=self.device)  # the last real token
        # The tokens' rows, for a decoder whose prefill input is made from them (DecodeIO.prefill).
        self.rows = (
            torch.zeros(largest, decode.io.row_width, dtype=self.slots.dtype, device=self.device)
            if decode.io.prefill is not None
            else None
        )
        config: Any = decode.decoder.config
        self.heads = int(config.num_attention_heads)
        # flex's main kernel runs a block per query head: a few queries over a long row read
        # the row in `splits` splits at once, enough to fill the GPU's multiprocessors.
        self.splits = 1
        if self.device.type == "cuda":
            processors = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.splits = max(1, min(MAX_SPLITS, processors // self.heads))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, dict[str, torch.Tensor]]] = {}
        self.pool: Any = None
        self.failed = False  # a recording failed: the eager prefill serves from then on
        self.runs = 0  # extends run (tests, metrics)
        self._forward_fn = self._forward
        if self.device.type == "cuda":
            self._forward_fn = torch.compile(self._forward, dynamic=False, mode=COMPILE_MODE)

    def bucket(self, count: int) -> int | None:
        """The size a forward of `count` tokens runs at; None when none takes it (or failed)."""
        if self.failed:
            return None
        return next((size for size in EXTEND_BUCKETS if size >= count), None)

    def ready(self, count: int) -> bool:
        """Whether a prefill of `count` tokens runs as an extend now: a bucket takes it and, on
        CUDA, that bucket's forward is recorded. Idle work records them ahead; until it has, the
        eager prefill serves, so a request never waits for a compile (up to a minute at real
        size) that an eager forward of tens of milliseconds spares it."""
        size = self.bucket(count)
        return size is not None and (self.device.type != "cuda" or size in self.graphs)

    def unrecorded(self) -> list[int]:
        """The sizes not recorded yet (none off CUDA, where nothing is recorded)."""
        if self.device.type != "cuda" or self.failed:
            return []
        return [size for size in EXTEND_BUCKETS if size not in self.graphs]

    @torch.no_grad()
    def prepare(self, size: int) -> None:
        """Record the forward of `size` tokens ahead of its first use (idle time); a recording
        that fails turns the extend off (the eager prefill serves) and is logged."""
        if size in self.graphs or self.failed:
            return
        try:
            self.graphs[size] = self._record(size)
        except Exception:
            log.exception("graphed extend: recording %d tokens failed; short prefills run eagerly", size)
            self.failed = True

    @torch.no_grad()
    def run(
        self, slot: KVSlot, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill `ids` [count] at rope `positions` [position_rows, count] after what `slot`
        caches, or, for a decoder whose prefill input is made from rows (DecodeIO.prefill),
        `rows` [count, row_width]; the slot then caches them too. Returns the last layer's rows
        and the input embeddings [count, hidden] and the last token's float logits [1, vocab]."""
        count = int(ids.shape[0])
        size = self.bucket(count)
        if size is None or slot.length + count > self.slots.capacity:
            raise ValueError(f"no graphed extend of {count} tokens after {slot.length}")
        if (rows is None) != (self.rows is None) or (rows is not None and rows.shape[0] != count):
            raise ValueError(
                "a graphed extend takes rows, one a token, exactly when its decoder's prefill reads them"
            )
        if self.rows is not None and rows is not None:
            self.rows[:count].copy_(rows)
        self.ids[:count].copy_(ids)
        self.positions[:, :count].copy_(positions)
        self.slot.fill_(slot.index)
        self.start.fill_(slot.length)
        self.last.fill_(count - 1)
        if self.device.type == "cuda":
            self.prepare(size)
            if self.failed:
                raise RuntimeError("the graphed extend failed to record")
            graph, outputs = self.graphs[size]
            assert graph is not None
            graph.replay()
        else:  # unrecorded: the same forward, eagerly
            outputs = self._outputs(size)
        slot.length += count
        self.runs += 1
        return outputs["hidden"][:count].clone(), outputs["embeds"][:count].clone(), outputs["logits"].clone()

    # ---- the forward, as recorded ----------------------------------------------------------
    def _record(self, size: int) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        """Warm up (compiles) on a side stream, then record. The warm-ups write keys and values
        into a row past its length only (slot 0 from 0 if nothing was set): no one reads them."""
        saved = self.start.clone()
        self.start.fill_(self.slots.capacity)  # every write clamps to the row's last position
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._outputs(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.start.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._outputs(size)
        self.pool = graph.pool()
        return graph, outputs

    def _outputs(self, size: int) -> dict[str, torch.Tensor]:
        hidden, embeds, logits = self._forward_fn(size)
        return {"hidden": hidden, "embeds": embeds, "logits": logits}

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        decode = self.decode
        capacity = self.slots.capacity
        steps = self.start + torch.arange(size, device=self.device)  # each token's position
        prefill = decode.io.prefill
        if prefill is not None and self.rows is not None:
            embeds = prefill(self.rows[:size])
        else:
            embeds = decode.decoder.embed_tokens(self.ids[:size])  # type: ignore[operator]
        output = decode.decoder(
            inputs_embeds=embeds.unsqueeze(0),
            position_ids=self.positions[:, :size].unsqueeze(1),
            use_cache=True,
            row_attention=self._row_attention(size, steps),
            **{decode.cache_argument: ExtendCache(self.slots, self.slot, steps.clamp(max=capacity - 1))},
        )
        hidden = output.last_hidden_state[0]
        last = hidden.index_select(0, self.last)
        return hidden, embeds, decode.lm_head(last).float()

    def _row_attention(self, size: int, steps: torch.Tensor) -> RowAttention:
        """Each query attends to the row up to its own position (`steps`): FlexAttention reading
        only the row's blocks up to the last query's (flex), or one SDPA over the whole row
        with a mask (padded: off CUDA, and heads too small for flex)."""
        capacity = self.slots.capacity
        if self.decode.attention == "padded":
            keep = torch.arange(capacity, device=self.device).view(1, -1) <= steps.view(-1, 1)
            return RowAttention("padded", padded_mask=keep.view(1, 1, size, capacity))
        groups = self.slots.shape[0]
        return causal_flex_rows(self.start, size, capacity, (self.heads, groups, self.splits))
