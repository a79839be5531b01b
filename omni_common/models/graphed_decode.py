"""The GPU decode path of a continuously batched generator (GLM-Image's prior, Qwen2.5-Omni's
thinker): one decode step over all the slots a batch spans, recorded once per batch-size bucket
as a CUDA graph and replayed every token, so the GPU never waits on the host.

What a step is, on the device only:
- the KV cache is KVSlots' buffers, preallocated once at their full size (`KVSlots.reserve`):
  a row per slot, so the graph's addresses never change; a row of the batch IS a slot (rows
  0..B-1 of the buffers), and slots in that span that do not step this time (free, or not in
  this step's batch) are padding: they compute, but nothing they make is kept;
- attention is one FlexAttention call per layer over every row, each row reading only its own
  tokens: a block mask built in the graph from the rows' lengths lists, per row, the 128-token
  KV blocks it holds (`ATTENTION` says why this one; `benchmarks/ar_generation.py --attention`
  measures it against per-row and padded SDPA);
- the next token is picked in the graph: the requests' logits processors (the same for every
  row: the step's batch key), then argmax, or softmax and an exponential race (what
  `torch.multinomial` does for one sample) with each slot's own generator, registered with
  every graph;
- the picked token is the next step's input, lengths and step counts advance, in the graph; the
  host reads the picked tokens one step late (a pinned copy and an event), so it never waits for
  the step it just launched.

What holds: a request's tokens depend on its seed and its slot's generator, not on its batch
mates' tokens (attention is per row; matrix products in bfloat16 were batch-invariant where
measured); they are not `generate`'s (another RNG stream, another attention kernel). The CPU
keeps the eager path, bitwise `generate` for a lone request (kv_slots.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from omni_common.models.fused_projections import fuse_projections
from omni_common.models.graphed_attention import ATTENTION, KV_BLOCK, RowAttention, flex_rows
from omni_common.models.kv_slots import KVSlots, cache_keyword
from omni_common.models.sampling import split_penalty

log = logging.getLogger("omnistage.graphed_decode")

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)  # batch sizes a graph is recorded for
# torch.compile's mode for the decode step (None: its default; benchmarks/ar_decode_gpu.py
# --compile-mode times the others, e.g. inductor's autotuned products for the skinny rows).
COMPILE_MODE: str | None = None


@dataclass(frozen=True)
class DecodeIO:
    """How a decoder's step differs from embed-the-token / decode / model head (the defaults):
    `inputs(ids [rows], row_inputs [rows, row_width] or None)` makes the step's input
    embeddings, from the picked tokens and each row's own input the host sets before a launch
    (`set_row_inputs`; Qwen2.5-Omni's talker adds a thinker row); `head` gives the logits;
    `prefill(rows [count, row_width])` makes a recorded prefill's (graphed_extend.py) input
    embeddings from its tokens' rows alone, where they are not its tokens' embeddings (the
    talker's prompt: its thinker rows, projected)."""

    inputs: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    head: torch.nn.Module | None = None
    row_width: int = 0
    prefill: Callable[[torch.Tensor], torch.Tensor] | None = None


class SlotRowsCache:
    """The `past_key_values` side of a recorded forward over KVSlots' whole rows (the attention's
    mask limits what each query reads): what transformers' mask helpers ask of a cache."""

    is_compileable = False

    def __init__(self, slots: KVSlots) -> None:
        self.slots = slots

    # Transformers' mask helpers size their (unused) masks from these; no host sync in them.
    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def get_query_offset(self, *args: Any, **kwargs: Any) -> int:
        return self.slots.capacity - 1

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.slots.capacity, 0


class GraphedCache(SlotRowsCache):
    """`past_key_values` of a graphed step: writes each row's new key/value at its length and
    hands the attention the rows' whole buffers (the mask limits what each row reads)."""

    def __init__(self, slots: KVSlots, rows: int, write_at: torch.Tensor) -> None:
        super().__init__(slots)
        self.rows = rows
        self.row_index = torch.arange(rows, device=write_at.device)
        self.write_at = write_at  # [rows] this step's position per row (its length before it)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Written through the whole buffers, not through views of their first rows: compiled,
        # an index_put into a view of a graph input is not done in place but as a copy of the
        # view, the write and a copy back (two copies of every row's KV a layer, 8 MB a row at
        # the talker's size), where one into the input itself is.
        keys, values = self.slots.keys[layer_idx], self.slots.values[layer_idx]
        keys[self.row_index, :, self.write_at] = key[:, :, 0]
        values[self.row_index, :, self.write_at] = value[:, :, 0]
        return keys[: self.rows], values[: self.rows]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder inside a transformers model (embeddings, layers, final norm), whatever
    the version nests it under."""
    for module in model.modules():
        if all(hasattr(module, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return module
    raise ValueError(f"{type(model).__name__} holds no text decoder")


@dataclass(eq=False)
class Launched:
    """A step the host has not read yet: its rows (slot indices), the pinned copy of its
    tokens (-1: the row's logits were not finite) and the event after that copy."""

    rows: list[int]
    tokens: torch.Tensor
    event: torch.cuda.Event | None  # None off CUDA (the step ran eagerly, it is done)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class GraphedDecode:
    """Decode steps of one decoder over KVSlots' rows, recorded per batch bucket and sampling
    key. `join` a slot after its prefill, then `launch` steps; the caller reads each step's
    `Launched` once its event has passed (SlotGenerator.graphed_step: a step late)."""

    def __init__(
        self,
        model: torch.nn.Module,
        slots: KVSlots,
        *,
        position_rows: int,
        max_steps: int,
        keep_rows: bool = False,
        attention: str = "flex",
        compile: bool = True,
        fuse: bool = True,
        io: DecodeIO | None = None,
    ) -> None:
        """`compile`: on CUDA, compile the forward (fusing its many small kernels) before it is
        recorded; a graph of eager kernels spends ~3 ms a step in their launches' gaps. `fuse`:
        on CUDA, run each layer's q/k/v and gate/up projections as one product each
        (fused_projections.py; prefills then run them so too). `io`: a decoder whose step input
        is not its token's embedding, or whose head is not the model's output embeddings."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, not {attention!r}")
        self.model = model
        self.decoder = decoder_of(model)
        if fuse and slots.device.type == "cuda":
            fuse_projections(self.decoder)
        io = io or DecodeIO()
        self.lm_head = io.head or cast(torch.nn.Module, model.get_output_embeddings())  # type: ignore[operator]
        self.inputs = io.inputs or (lambda ids, rows: self.decoder.embed_tokens(ids))  # type: ignore[operator]
        self.io = io
        self.slots = slots
        # FlexAttention is a compiled (Triton) kernel: off CUDA the padded form checks the step.
        self.attention = attention if slots.device.type == "cuda" else "padded"
        self.keep_rows = keep_rows  # also keep each row's last hidden + input embedding (talker)
        self.position_rows = position_rows
        self._forward_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._forward
        if compile and slots.device.type == "cuda":
            # One compiled forward per bucket size (static shapes): raise dynamo's recompile
            # limit to the number of buckets.
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 2 * len(BUCKETS)))
            self._forward_fn = torch.compile(self._forward, dynamic=False, mode=COMPILE_MODE)
        self.cache_argument = cache_keyword(self.decoder)
        device, slot_count = slots.device, slots.max_slots
        self.device = device
        # Per slot, written by `join` and advanced by the graphs.
        self.next_ids = torch.zeros(slot_count, dtype=torch.long, device=device)
        self.lengths = torch.zeros(slot_count, dtype=torch.long, device=device)  # tokens cached
        self.steps = torch.zeros(slot_count, dtype=torch.long, device=device)  # tokens picked
        self.active = torch.zeros(slot_count, dtype=torch.long, device=device)
        # Rope positions of each slot's picked tokens: [slots, position_rows, max_steps].
        self.rope = torch.zeros(slot_count, position_rows, max_steps, dtype=torch.long, device=device)
        self.generators = [torch.Generator(device) for _ in range(slot_count)]
        # Per slot, written by the host before a launch: each row's step input (DecodeIO).
        self.row_inputs = (
            torch.zeros(slot_count, io.row_width, dtype=slots.dtype, device=device) if io.row_width else None
        )
        self._seen: torch.Tensor | None = None  # per slot, the tokens seen ([slots, vocab] bool)
        # Per (bucket, sampling key): the recorded step and its outputs (None, {} off CUDA).
        self.graphs: dict[
            tuple[int, Hashable], tuple[torch.cuda.CUDAGraph | None, dict[str, torch.Tensor]]
        ] = {}
        self.pool: Any = None
        self.captures = 0  # graphs recorded, for tests: none per request
        self._active_rows: tuple[int, ...] = ()
        block_count = slots.capacity // KV_BLOCK
        self.kv_indices = (
            torch.arange(block_count, dtype=torch.int32, device=device)
            .view(1, 1, 1, -1)
            .expand(slot_count, 1, 1, -1)
        ).contiguous()

    # ---- host side -------------------------------------------------------------------------
    def join(
        self,
        slot: int,
        first_token: torch.Tensor,
        length: int,
        positions: torch.Tensor | None,
        generator: torch.Generator,
        seen: torch.Tensor | None = None,
    ) -> None:
        """Make slot `slot` a row: `length` tokens cached (its prefill), `first_token` ([1] or
        [1, 1], on the device) picked, `positions` [position_rows, n] the rope positions of its
        picked tokens (None: text positions, length + i in every row), `generator` its stream,
        `seen` the ids its repetition penalty reads so far (prompt and picked), if it has one."""
        self.next_ids[slot : slot + 1].copy_(first_token.view(-1)[:1])
        self.lengths[slot].fill_(length)  # (a kernel: assigning an int would copy it over and wait)
        self.steps[slot].fill_(1)
        if positions is None:
            count = self.rope.shape[2]
            positions = torch.arange(length, length + count, device=self.device).expand(
                self.position_rows, -1
            )
        self.rope[slot, :, : positions.shape[1]] = positions[:, : self.rope.shape[2]]
        # The request's own stream goes on where its prefill's draw left it: the same draws
        # `torch.multinomial` (one sample: an exponential race) would take next.
        self.generators[slot].set_state(generator.get_state())
        if seen is not None:
            mask = self.seen_mask()
            mask[slot] = False
            mask[slot, seen.view(-1).to(self.device)] = True

    def seen_mask(self) -> torch.Tensor:
        """[slots, vocab] bool: the tokens each slot's row has seen (its repetition penalty's);
        allocated once, before any step that reads it is recorded."""
        if self._seen is None:
            vocab = int(cast(torch.Tensor, self.lm_head.weight).shape[0])
            self._seen = torch.zeros(self.slots.max_slots, vocab, dtype=torch.bool, device=self.device)
        return self._seen

    def set_row_inputs(self, rows: Sequence[int], values: torch.Tensor) -> None:
        """The next step's input of each slot in `rows` ([len(rows), row_width])."""
        assert self.row_inputs is not None, "this decoder takes no row inputs (DecodeIO.row_width)"
        index = torch.tensor(list(rows), device=self.device)
        self.row_inputs.index_copy_(0, index, values.to(self.row_inputs.dtype))

    def bucket(self, rows: Sequence[int]) -> int:
        span = max(rows) + 1
        for size in BUCKETS:
            if size >= span:
                return min(size, self.slots.max_slots)
        return self.slots.max_slots

    def bucket_sizes(self) -> list[int]:
        """Every batch size a step is recorded for (the buckets up to the slots)."""
        return sorted({min(size, self.slots.max_slots) for size in BUCKETS})

    @torch.no_grad()
    def prepare(self, size: int, key: Hashable, processors: Any, do_sample: bool) -> None:
        """Record the step of `size` rows under sampling `key` ahead of its first launch (idle
        time), so no request waits for its compilation; nothing off CUDA or if recorded."""
        if self.device.type == "cuda" and (size, key) not in self.graphs:
            self.graphs[size, key] = self._record(size, processors, do_sample)

    @torch.no_grad()
    def launch(self, rows: Sequence[int], key: Hashable, processors: Any, do_sample: bool) -> Launched:
        """Replay (record first, once per bucket and key) one step for slots `rows`."""
        size = self.bucket(rows)
        if tuple(rows) != self._active_rows:  # joins and leaves only: one small copy then
            cuda = self.device.type == "cuda"
            mask = torch.zeros(self.slots.max_slots, dtype=torch.long, pin_memory=cuda)
            mask[list(rows)] = 1
            self.active.copy_(mask, non_blocking=cuda)
            self._active_rows = tuple(rows)
        entry = self.graphs.get((size, key))
        if entry is None:
            entry = self._record(size, processors, do_sample) if self.device.type == "cuda" else (None, {})
            self.graphs[size, key] = entry
        graph, outputs = entry
        if graph is None:  # not recording (off CUDA): the same step, run eagerly
            outputs = self._step(size, processors, do_sample, self.generators[:size])
        else:
            graph.replay()
        cuda = self.device.type == "cuda"
        tokens = torch.empty(size, dtype=torch.long, pin_memory=cuda)
        tokens.copy_(outputs["tokens"], non_blocking=cuda)
        extra = {"rows": outputs["rows"].clone()} if self.keep_rows else {}
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        return Launched(list(rows), tokens, event, extra)

    # ---- the step, as recorded -------------------------------------------------------------
    def _record(
        self, size: int, processors: Any, do_sample: bool
    ) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
        """Warm up (compiles FlexAttention for this shape) on a side stream, then record."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up(size, processors, do_sample)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        for generator in self.generators[:size]:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._step(size, processors, do_sample, self.generators[:size])
        self.pool = graph.pool()
        self.captures += 1
        return graph, outputs

    def _warm_up(self, size: int, processors: Any, do_sample: bool) -> None:
        """Step rows 0..size-1 twice (what compiles this shape), then put every row back as it
        was: its next token, length, step count and seen codes (a recording can come while
        requests are live: the warm-ups' picks are nobody's). Their draws come from scratch
        generators, so the rows' own streams stay where they are; their KV writes land at each
        row's length, where its next step writes again."""
        penalty, _ = split_penalty(processors)
        state = [self.next_ids, self.lengths, self.steps]
        if penalty is not None:
            state.append(self.seen_mask())
        saved = [tensor.clone() for tensor in state]
        scratch = [torch.Generator(self.device) for _ in range(size)]
        for _ in range(2):
            self._step(size, processors, do_sample, scratch)
        for tensor, value in zip(state, saved, strict=True):
            tensor.copy_(value)

    def _row_attention(self, size: int, kv_length: torch.Tensor) -> RowAttention:
        capacity = self.slots.capacity
        if self.attention == "padded":
            mask = torch.arange(capacity, device=self.device).view(1, 1, 1, -1) < kv_length.view(-1, 1, 1, 1)
            return RowAttention("padded", padded_mask=mask)

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return kv < kv_length[b]

        blocks = ((kv_length + KV_BLOCK - 1) // KV_BLOCK).to(torch.int32).view(size, 1, 1)
        return flex_rows(blocks, self.kv_indices[:size], mask_mod, 1, capacity)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' decoder forward (compiled on CUDA): (last hidden [size, H], input
        embeddings [size, H], float32 logits [size, vocab])."""
        lengths = self.lengths[:size]
        index = (self.steps[:size] - 1).clamp(min=0, max=self.rope.shape[2] - 1).view(size, 1, 1)
        positions = torch.gather(self.rope[:size], 2, index.expand(-1, self.position_rows, 1)).transpose(0, 1)
        rows = None if self.row_inputs is None else self.row_inputs[:size]
        embeds = self.inputs(self.next_ids[:size], rows)
        output = self.decoder(
            inputs_embeds=embeds.unsqueeze(1),
            position_ids=positions,
            use_cache=True,
            row_attention=self._row_attention(size, lengths + 1),
            **{self.cache_argument: GraphedCache(self.slots, size, lengths)},
        )
        hidden = output.last_hidden_state[:, 0]
        return hidden, embeds, self.lm_head(hidden).float()

    def _step(
        self, size: int, processors: Any, do_sample: bool, generators: Sequence[torch.Generator]
    ) -> dict[str, torch.Tensor]:
        """A step of rows 0..size-1: the forward, the pick, the rows advanced (active ones)."""
        active = self.active[:size]
        ids = self.next_ids[:size]
        hidden, embeds, scores = self._forward_fn(size)
        finite = torch.isfinite(scores).all(dim=-1)
        penalty, processors = split_penalty(processors)
        if penalty is not None:  # transformers' repetition penalty, from each row's mask of seen
            seen = self.seen_mask()[:size]
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        if processors:
            scores = processors(None, scores)
        if do_sample:  # what torch.multinomial does for one sample, a generator per row
            probs = torch.softmax(scores, dim=-1)
            race = torch.stack([torch.empty_like(probs[0]).exponential_(1, generator=g) for g in generators])
            picked = (probs / race).argmax(dim=-1)
        else:
            picked = scores.argmax(dim=-1)
        tokens = torch.where(finite, picked, -1)
        self.next_ids[:size].copy_(torch.where(active.bool(), picked, ids))
        if penalty is not None:
            row = torch.arange(size, device=self.device)
            seen = self.seen_mask()
            seen[row, picked] = seen[row, picked] | active.bool()
        self.lengths[:size].add_(active)
        self.steps[:size].add_(active)
        outputs = {"tokens": tokens}
        if self.keep_rows:
            outputs["rows"] = hidden + embeds
        return outputs
