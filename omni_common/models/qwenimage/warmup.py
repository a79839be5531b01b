"""Compile and capture the DiT ahead of its first request, with progress in the log.

For each size the stage is told it will serve (--capture-sizes) and each batch bucket up to
--max-batch, the warm-up runs every forward a request of that shape can take:
- the CUDA graphs (graphs.GraphedTransformer), to time whether a replay pays: for one request,
  a graph of one exact prompt length (unmasked); for several, prompts of different lengths
  padded to 32 and 64 tokens under a mask. Requests capture the lengths they bring on first
  use, timed no more. With the compile cache, the timings of a previous start are known and
  nothing is captured here: a graph of made-up lengths would serve few requests;
- the forward on real shapes, which a bucket without a graph runs: unmasked at two prompt
  lengths and masked once (prompts of different lengths batched), at one and two requests
  of each size, so the compiled blocks take the prompt length, the batch and the image size
  as dynamic from the start and no request waits for a recompilation. Larger batches reuse
  the dynamic code (PyTorch specialises sizes 0 and 1 only): running them too would spend
  device time and compile nothing.
With a warm compile cache (--compile-cache) each of these loads instead of compiling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from omni_common.models.qwenimage.graphs import BATCH_BUCKETS, TEXT_BUCKETS, GraphedTransformer, ImgShapes
from omni_common.runtime.cuda_graphs import Inputs

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


def warm_up(
    forward: Forward,
    graphed: GraphedTransformer | None,
    img_shapes: list[tuple[int, int, int]],
    max_batch: int,
    channels: int,
    text_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Run (and so compile and capture) every forward shape of `img_shapes` (frames, patch
    rows, patch columns) up to `max_batch` requests; logs one line per shape done."""
    rows = [b for b in BATCH_BUCKETS if b <= max_batch]
    shapes = [(img_shape, batch) for img_shape in img_shapes for batch in rows]
    started = time.perf_counter()
    for i, (img_shape, batch) in enumerate(shapes, 1):
        _, height, width = img_shape
        with torch.inference_mode():
            if graphed is not None and batch == 1:
                graphed.time_bucket(batch, img_shape, REAL_TEXT_TOKENS[0], dtype, masked=False)
            elif graphed is not None:
                for text in (t for t in TEXT_BUCKETS if t <= CAPTURE_TEXT_TOKENS):
                    graphed.time_bucket(batch, img_shape, text, dtype, masked=True)
            if batch in REAL_SHAPE_BATCHES:
                real_shapes(forward, batch, img_shape, channels, text_dim, dtype, device)
        log.info(
            "warm-up %d/%d: batch %d at %dx%d patches compiled%s (%.1f s so far)",
            i,
            len(shapes),
            batch,
            height,
            width,
            " and captured" if graphed is not None else "",
            time.perf_counter() - started,
        )


def real_shapes(
    forward: Forward,
    batch: int,
    img_shape: tuple[int, int, int],
    channels: int,
    text_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The forward on real shapes of `batch` requests: unmasked at each of REAL_TEXT_TOKENS,
    then masked (prompts of different lengths batched: the last one padded)."""
    frames, height, width = img_shape
    latents = torch.zeros((batch, frames * height * width, channels), dtype=dtype, device=device)
    timestep = torch.full((batch,), 1000.0, dtype=dtype, device=device)
    rows_shapes = [[img_shape]] * batch
    for length in REAL_TEXT_TOKENS:
        embeds = torch.zeros((batch, length, text_dim), dtype=dtype, device=device)
        forward({"latents": latents, "timestep": timestep, "embeds": embeds}, rows_shapes)
    mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=device)
    mask[0, -1] = 0
    forward({"latents": latents, "timestep": timestep, "embeds": embeds, "mask": mask}, rows_shapes)
