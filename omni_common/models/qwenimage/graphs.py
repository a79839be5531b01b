"""QwenImageTransformer2DModel's forward as replayed CUDA graphs.

A graph needs static shapes, so a forward's inputs are padded: the batch to the next of
BATCH_BUCKETS (extra rows repeat the first, and are dropped). Rows whose prompts share one
length and no mask (one request, or requests of equal prompt lengths) get a graph of that
exact length: no mask, so attention keeps its fastest kernel (cuDNN's flash kernel on an H200
runs a masked joint attention ~1.7x slower: 13 ms of a 1024x1024 step, docs/benchmarks.md).
Prompts of different lengths are padded with zero embeddings masked out, to the next multiple
of TEXT_ALIGN tokens: padding costs every row compute (8 prompts of 24-37 tokens padded to 64
would add 2.5% to a 512x512 forward), so a graph per 8 tokens pays for itself. Whether a
replay pays is timed once per TEXT_BUCKETS bucket. The padding is exact in value: a masked
text token reaches no other token (the joint attention's key mask). It is not bitwise: the
masked attention kernel sums in another order than the unmasked one, so a graphed forward
equals the eager one up to float rounding (tests/gpu check both).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from omni_common.execution.compile_cache import decisions_for
from omni_common.execution.cuda_graphs import CudaGraphCache, Inputs

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
TEXT_BUCKETS = (32, 64, 128, 256, 512, 1024)
TEXT_ALIGN = 8  # masked graphs pad prompts to a multiple of this many tokens

ImgShapes = list[list[tuple[int, int, int]]]
# The transformer call of QwenImagePipeline's loop, on named inputs (execution.transformer_forward).
Forward = Callable[[QwenImageTransformer2DModel, Inputs, ImgShapes], torch.Tensor]
# A piece of that forward on named inputs (the step cache's later blocks, step_cache.py).
Part = Callable[[Inputs, ImgShapes], torch.Tensor]


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `value`; None when none does."""
    return next((b for b in buckets if b >= value), None)


def padded_inputs(
    latents: torch.Tensor,
    timestep: torch.Tensor,
    embeds: torch.Tensor,
    mask: torch.Tensor | None,
    batch: int,
    text: int,
    modulation: torch.Tensor | None = None,
) -> Inputs:
    """One forward's inputs padded to `batch` rows and `text` prompt tokens, with the int64
    text mask (1 valid, 0 padding) that makes the padding invisible; no mask when the prompts
    are `text` tokens long and unmasked already."""
    rows, length = embeds.shape[:2]
    padded = {"latents": latents, "timestep": timestep, "embeds": F.pad(embeds, (0, 0, 0, text - length))}
    if modulation is not None:
        padded["modulation"] = modulation
    if mask is not None or text != length:
        if mask is None:
            mask = torch.ones((rows, length), dtype=torch.long, device=embeds.device)
        padded["mask"] = F.pad(mask.to(torch.long), (0, text - length))
    return pad_rows(padded, batch)


def pad_rows(inputs: Inputs, batch: int) -> Inputs:
    """`inputs` (equal row counts) with their first row repeated up to `batch` rows."""
    rows = next(iter(inputs.values())).shape[0]
    if batch <= rows:
        return inputs
    return {
        name: torch.cat([value, value[:1].expand(batch - rows, *value.shape[1:])])
        for name, value in inputs.items()
    }


class GraphKey(NamedTuple):
    """Which graph a forward replays: its inputs padded to `batch` rows and `text` prompt
    tokens (the prompts' own length unmasked, the next multiple of TEXT_ALIGN masked), and
    its `decision`: whether a replay pays is timed once per text bucket, so prompts of 17
    and 23 tokens replay alike and a new length does not time its graph again."""

    batch: int
    text: int
    decision: tuple[object, ...]

    @property
    def graph(self) -> tuple[object, ...]:
        return (*self.decision, self.text)


def graph_key(
    rows: int,
    img_shape: tuple[int, int, int],
    length: int,
    masked: bool,
    dtype: torch.dtype,
    modulated: bool,
) -> GraphKey | None:
    """The graph of a forward of `rows` prompts of up to `length` tokens; None when no
    bucket holds it."""
    batch, text = bucket(rows, BATCH_BUCKETS), bucket(length, TEXT_BUCKETS)
    if batch is None or text is None:
        return None
    frames, height, width = img_shape
    decision = (batch, text, masked, frames * height * width, img_shape, dtype, modulated)
    return GraphKey(batch, min(-(-length // TEXT_ALIGN) * TEXT_ALIGN, text) if masked else length, decision)


@contextlib.contextmanager
def capturable_text_mask() -> Iterator[None]:
    """While capturing, swap diffusers' `compute_text_seq_len_from_mask` for one without its
    per-sample lengths.

    diffusers 0.42 builds those lengths with `torch.as_tensor(int, device=...)`, a host to
    device copy that a CUDA graph capture refuses; QwenImageTransformer2DModel.forward
    discards them (it keeps the sequence length and the bool mask, which this returns the
    same). tests/unit/models/qwenimage/test_graphs.py pins that the forward is unchanged.
    """
    original = transformer_qwenimage.compute_text_seq_len_from_mask

    def without_lengths(
        encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None
    ) -> tuple[int, None, torch.Tensor | None]:
        mask = encoder_hidden_states_mask
        return encoder_hidden_states.shape[1], None, (None if mask is None else mask.to(torch.bool))

    transformer_qwenimage.compute_text_seq_len_from_mask = without_lengths
    try:
        yield
    finally:
        transformer_qwenimage.compute_text_seq_len_from_mask = original


class GraphedTransformer:
    """The transformer's forward by bucket: captured on first use (or ahead, `capture`) and
    replayed after where a replay pays. A bucket without a graph, or a shape beyond the
    largest bucket, returns None: the caller runs the forward on the real shapes, with no
    padding and no mask where none is needed (the masked attention costs 3-7% at 1024x1024,
    docs/benchmarks.md), compiled for dynamic prompt lengths ahead (warmup.py)."""

    def __init__(
        self,
        transformer: QwenImageTransformer2DModel,
        forward: Forward,
        device: torch.device,
        max_graphs: int = 256,
        modulation_width: int | None = None,
    ) -> None:
        self.transformer = transformer
        self.forward = forward
        self.device = device
        # Columns of the packed modulation rows the forward takes (modulation.py); None: none.
        self.modulation_width = modulation_width
        decisions = decisions_for("cuda-graphs", device, dict(transformer.config))
        self.cache = CudaGraphCache(device, max_graphs=max_graphs, decisions=decisions)
        # Graphs to capture while the stage is idle: (image shape, prompt tokens, dtype).
        self._idle: deque[tuple[tuple[int, int, int], int, torch.dtype]] = deque()

    def __call__(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        img_shapes: ImgShapes,
        modulation: torch.Tensor | None = None,
        spread: Hashable | None = None,
    ) -> torch.Tensor | None:
        """The forward replayed (captured first if new); None: the caller runs it eagerly.
        `spread` names the group of ranks a sequence-parallel forward spreads over (None: this
        device alone): its graph holds the group's collectives, so every rank of the group
        captures it at the same call and keeps it (`CudaGraphCache.run`'s lockstep), and its
        rows are never padded (no timing says whether padding pays)."""
        rows = latents.shape[0]
        key = graph_key(
            rows, img_shapes[0][0], embeds.shape[1], mask is not None, latents.dtype, modulation is not None
        )
        if key is None or (spread is not None and key.batch != rows):
            return None
        if spread is not None:
            key = key._replace(decision=(*key.decision, "spread", spread))
        speedup = self.cache.speedup(key.graph)
        if speedup is not None and speedup * rows < key.batch:
            # The padded rows would cost more than the replay saves (compute-bound shapes):
            # 3 requests at 1024x1024 run as 3, not as a replay of 4.
            return None
        inputs = padded_inputs(latents, timestep, embeds, mask, key.batch, key.text, modulation)
        shapes = [img_shapes[0]] * key.batch

        def run(static: Inputs) -> torch.Tensor:
            with capturable_text_mask():
                return self.forward(self.transformer, static, shapes)

        output = self.cache.run(
            key.graph, inputs, run, decision_key=key.decision, lockstep=spread is not None
        )
        return None if output is None else output[:rows]

    def replay_part(
        self, name: str, inputs: Inputs, img_shapes: ImgShapes, part: Part, text_input: str = "encoder"
    ) -> torch.Tensor | None:
        """`part(inputs, img_shapes)`, a piece of the forward whose rows share one image shape,
        as a graph of its own (`name` keeps its keys apart from the whole forward's), bucketed
        as the forward is: rows padded to the next batch bucket; the text stream `text_input`
        [rows, tokens, dim] at its own length, or, with a "mask" [rows, tokens] (valid tokens
        true), padded with zeros masked out to the next multiple of TEXT_ALIGN (`part` gets an
        int64 mask). None where no bucket holds the rows or a replay does not pay: the caller
        runs `part` itself."""
        rows, length = inputs[text_input].shape[:2]
        masked = "mask" in inputs
        key = graph_key(rows, img_shapes[0][0], length, masked, inputs[text_input].dtype, modulated=False)
        if key is None:
            return None
        if masked:
            pad = key.text - length
            inputs = {
                **inputs,
                text_input: F.pad(inputs[text_input], (0, 0, 0, pad)),
                "mask": F.pad(inputs["mask"].to(torch.long), (0, pad)),
            }
        padded_shapes = [img_shapes[0]] * key.batch

        def run(static: Inputs) -> torch.Tensor:
            with capturable_text_mask():
                return part(static, padded_shapes)

        decision = (name, *key.decision)
        output = self.cache.run(
            (*decision, key.text), pad_rows(inputs, key.batch), run, decision_key=decision
        )
        return None if output is None else output[:rows]

    def time_bucket(
        self, rows: int, img_shape: tuple[int, int, int], text: int, dtype: torch.dtype, *, masked: bool
    ) -> None:
        """Time whether a replay pays for the bucket of `rows` requests at one image shape
        (frames, patch rows, patch columns), by capturing (and compiling) its graph ahead of
        the first request: `masked`, prompts padded to `text` tokens; otherwise prompts of
        exactly `text` tokens. Nothing to do when that is known already (the compile cache
        remembers it): a warm start captures no graph of made-up lengths."""
        if self.needs_timing(rows, img_shape, text, dtype, masked=masked):
            self._capture(rows, img_shape, text, dtype, masked=masked)

    def needs_timing(
        self, rows: int, img_shape: tuple[int, int, int], text: int, dtype: torch.dtype, *, masked: bool
    ) -> bool:
        """Whether time_bucket has work to do: the bucket's gain is not known yet."""
        key = graph_key(rows, img_shape, text, masked, dtype, self.modulation_width is not None)
        if key is None:
            raise ValueError(f"no graph bucket holds {rows} rows of {text} prompt tokens")
        return not self.cache.decided(key.decision)

    def plan_idle_captures(
        self, img_shapes: list[tuple[int, int, int]], lengths: range, dtype: torch.dtype
    ) -> None:
        """Graphs for one request at each of `img_shapes` with a prompt of each of `lengths`
        tokens, captured one by one while the stage is idle (capture_idle): a request of such
        a length then replays from its first step, instead of paying a capture (0.1-0.3 s on
        an H200, most of it host time, at either size)."""
        self._idle = deque((shape, length, dtype) for length in lengths for shape in img_shapes)

    def capture_idle(self) -> bool:
        """Capture the next planned graph that no request has captured yet, unless replays are
        known not to pay (a text bucket not timed yet is timed now); False when none is left."""
        while self._idle:
            img_shape, length, dtype = self._idle.popleft()
            key = graph_key(1, img_shape, length, False, dtype, self.modulation_width is not None)
            if key is None or self.cache.speedup(key.graph) is not None:
                continue
            if self.cache.decided(key.decision) and not self.cache.pays(key.decision):
                continue
            self._capture(1, img_shape, length, dtype, masked=False)
            return True
        return False

    @property
    def idle_captures_left(self) -> int:
        return len(self._idle)

    def clear(self) -> None:
        """Drop every graph, and the plan of graphs to capture while idle (the weights are about
        to move: after a wake, requests capture what they need)."""
        self.cache.clear()
        self._idle.clear()

    def _capture(
        self, rows: int, img_shape: tuple[int, int, int], text: int, dtype: torch.dtype, *, masked: bool
    ) -> None:
        """Run the graphed forward once on zeros of that shape: captures its graph if new."""
        frames, height, width = img_shape
        modulation = None
        if self.modulation_width is not None:
            modulation = torch.zeros((rows, self.modulation_width), dtype=dtype, device=self.device)
        channels = self.transformer.config["in_channels"]
        dim = self.transformer.config["joint_attention_dim"]
        mask = torch.ones((rows, text), dtype=torch.long, device=self.device) if masked else None
        self(
            torch.zeros((rows, frames * height * width, channels), dtype=dtype, device=self.device),
            torch.full((rows,), 1000.0, dtype=dtype, device=self.device),
            torch.zeros((rows, text, dim), dtype=dtype, device=self.device),
            mask,
            [[img_shape]] * rows,
            modulation,
        )
