"""Compile and capture the DiT ahead of its first request, with progress in the log.

For each size the stage is told it will serve (--capture-sizes) and each batch bucket up to
--max-batch, the warm-up runs every forward a request of that shape can take:
- the forward on real shapes, which a bucket without a graph runs: unmasked at two prompt
  lengths and masked once (prompts of different lengths batched), at one and two requests
  of each size, so the compiled blocks take the prompt length, the batch and the image size
  as dynamic from the start and no request waits for a recompilation. Larger batches reuse
  the dynamic code (PyTorch specialises sizes 0 and 1 only): running them too would spend
  device time and compile nothing;
- the CUDA graphs (graphs.GraphedTransformer), to time whether a replay pays: for one request,
  a graph of one exact prompt length (unmasked); for several, prompts of different lengths
  padded to 32 and 64 tokens under a mask. Requests capture the lengths they bring on first
  use, timed no more. With the compile cache, the timings of a previous start are known and
  nothing is captured here: a graph of made-up lengths would serve few requests.
One request at each size comes first, then the rest size by size, each shape's real forwards
before its graphs. The order matters: the compiler makes a dimension dynamic once it sees it
change, so what it compiles depends on the order of the forwards, and a warm start (which times
no graph) must run them in the cold start's order to load all of it from the cache.

With a warm compile cache (--compile-cache) each of these loads instead of compiling, and a
stage whose scheduler runs idle work (one device) serves once one request at each size runs
compiled. The rest then loads one forward at a time while no request is here (1-3 s each for
Qwen-Image on an H200), and a request that needs one sooner loads it itself. A cold start
compiles everything before it serves: a compile there takes 10-20 s, too long for a request
to wait.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_common.execution.cuda_graphs import Inputs
from omni_common.models.qwenimage.graphs import BATCH_BUCKETS, TEXT_BUCKETS, GraphedTransformer, ImgShapes

log = logging.getLogger("omnistage.warmup")

# Graphs captured at start cover prompts of up to this many tokens (most prompts); a longer
# prompt's bucket is captured when it first comes.
CAPTURE_TEXT_TOKENS = 64
# Prompt lengths whose graphs (one request, each size warmed up) are captured while the stage
# is idle, after the warm-up: most prompts once the template's prefix is dropped.
IDLE_CAPTURE_TOKENS = range(4, CAPTURE_TEXT_TOKENS + 1)
# Two real prompt lengths: the second makes the compiler generalise the first.
REAL_TEXT_TOKENS = (17, 23)
# Real shapes run at these batch sizes: 1 is compiled on its own, 2 makes the batch dynamic.
REAL_SHAPE_BATCHES = (1, 2)

Forward = Callable[[Inputs, ImgShapes], torch.Tensor]


@dataclass(frozen=True)
class WarmUpStep:
    """One piece of the warm-up: a forward run (compiled, or loaded from the compile cache) or
    a CUDA graph bucket timed."""

    label: str
    run: Callable[[], object]
    ahead: bool  # one request at one size takes it: a warm start serves once these ran


class WarmUp:
    """The warm-up's steps in order: run ahead of serving (`run_ahead`), then, where deferred,
    one per `run_next` while the stage is idle."""

    def __init__(self, steps: list[WarmUpStep]) -> None:
        self._left = deque(steps)
        self.total = len(steps)
        self._spent_s = 0.0

    @property
    def left(self) -> int:
        return len(self._left)

    def run_ahead(self, *, defer: bool) -> None:
        """Every step; with `defer`, only the leading ones one request at a size takes (the
        rest waits for `run_next`)."""
        while self._left and (not defer or self._left[0].ahead):
            self.run_next()
        if self._left:
            log.info(
                "warm-up: serving after %d of %d steps (%.1f s); the other %d load while idle",
                self.total - self.left,
                self.total,
                self._spent_s,
                self.left,
            )

    def run_next(self) -> bool:
        """Run the next step; False when none is left."""
        if not self._left:
            return False
        step = self._left.popleft()
        started = time.perf_counter()
        with torch.inference_mode():
            step.run()
        self._spent_s += time.perf_counter() - started
        done = self.total - self.left
        log.info("warm-up %d/%d: %s (%.1f s so far)", done, self.total, step.label, self._spent_s)
        return True


def warm_up(
    forward: Forward,
    graphed: GraphedTransformer | None,
    img_shapes: list[tuple[int, int, int]],
    max_batch: int,
    channels: int,
    text_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    defer: bool = False,
    only: Callable[[int, tuple[int, int, int]], bool] = lambda batch, img_shape: True,
) -> WarmUp:
    """Run (and so compile and capture) every forward shape of `img_shapes` (frames, patch
    rows, patch columns) up to `max_batch` requests, logging each step; with `defer`, only
    those of one request at each shape: the rest is left in the WarmUp returned. `only(batch,
    img_shape)` picks the shapes (in the same order)."""

    def real(batch: int, img_shape: tuple[int, int, int]) -> RealShape:
        return RealShape(forward, batch, img_shape, channels, text_dim, dtype, device)

    steps = [
        step
        for img_shape in img_shapes
        if only(1, img_shape)
        for step in real(1, img_shape).steps(masked=False, ahead=True)
    ]
    for img_shape in img_shapes:
        for batch in (b for b in BATCH_BUCKETS if b <= max_batch and only(b, img_shape)):
            if batch in REAL_SHAPE_BATCHES:
                shape = real(batch, img_shape)
                if batch > 1:  # one request's unmasked steps came first
                    steps += shape.steps(masked=False, ahead=False)
                steps += shape.steps(masked=True, ahead=False)
            if graphed is not None:
                steps += graph_timings(graphed, batch, img_shape, dtype)
    warm = WarmUp(steps)
    warm.run_ahead(defer=defer)
    return warm


def graph_timings(
    graphed: GraphedTransformer, batch: int, img_shape: tuple[int, int, int], dtype: torch.dtype
) -> list[WarmUpStep]:
    """The graph buckets of `batch` requests at `img_shape` whose gain is not known yet: one
    exact prompt length for one request, prompts padded to each text bucket under a mask for
    several."""
    if batch == 1:
        buckets = [(REAL_TEXT_TOKENS[0], False)]
    else:
        buckets = [(text, True) for text in TEXT_BUCKETS if text <= CAPTURE_TEXT_TOKENS]
    where = shape_label(batch, img_shape)
    return [
        WarmUpStep(
            f"{where}, CUDA graph of {text}{' masked' if masked else ''} prompt tokens timed",
            functools.partial(graphed.time_bucket, batch, img_shape, text, dtype, masked=masked),
            ahead=False,
        )
        for text, masked in buckets
        if graphed.needs_timing(batch, img_shape, text, dtype, masked=masked)
    ]


def shape_label(batch: int, img_shape: tuple[int, int, int]) -> str:
    return f"batch {batch} at {img_shape[1]}x{img_shape[2]} patches"


@dataclass(frozen=True)
class RealShape:
    """The forward on real shapes of `batch` requests at one image shape (no graph)."""

    forward: Forward
    batch: int
    img_shape: tuple[int, int, int]
    channels: int
    text_dim: int
    dtype: torch.dtype
    device: torch.device

    def steps(self, *, masked: bool, ahead: bool) -> list[WarmUpStep]:
        """Unmasked: prompts of each of REAL_TEXT_TOKENS (the second makes the prompt length
        dynamic); masked: prompts of different lengths batched, once."""
        label = shape_label(self.batch, self.img_shape)
        if masked:
            run = functools.partial(self.run, REAL_TEXT_TOKENS[-1], masked=True)
            return [WarmUpStep(f"{label}, prompts of different lengths (masked)", run, ahead)]
        return [
            WarmUpStep(
                f"{label}, prompts of {length} tokens",
                functools.partial(self.run, length, masked=False),
                ahead,
            )
            for length in REAL_TEXT_TOKENS
        ]

    def run(self, length: int, *, masked: bool) -> torch.Tensor:
        """Prompts of `length` tokens; `masked`: batched with a shorter one (its last token
        masked out), as prompts of different lengths are."""
        frames, height, width = self.img_shape
        batch, dtype, device = self.batch, self.dtype, self.device
        latents = torch.zeros((batch, frames * height * width, self.channels), dtype=dtype, device=device)
        inputs = {
            "latents": latents,
            "timestep": torch.full((batch,), 1000.0, dtype=dtype, device=device),
            "embeds": torch.zeros((batch, length, self.text_dim), dtype=dtype, device=device),
        }
        if masked:
            mask = torch.ones((batch, length), dtype=torch.long, device=device)
            mask[0, -1] = 0
            inputs["mask"] = mask
        return self.forward(inputs, [[self.img_shape]] * batch)
