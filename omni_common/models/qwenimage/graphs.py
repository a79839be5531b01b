"""QwenImageTransformer2DModel's forward as replayed CUDA graphs.

A graph needs static shapes, so a forward's inputs are padded: the batch to the next of
BATCH_BUCKETS (extra rows repeat the first, and are dropped). Rows whose prompts share one
length and no mask (one request, or requests of equal prompt lengths) get a graph of that
exact length: no mask, so attention keeps its fastest kernel (cuDNN's flash kernel on an H200
runs a masked joint attention ~1.7x slower: 13 ms of a 1024x1024 step, docs/benchmarks.md).
Prompts of different lengths are padded to the next of TEXT_BUCKETS with zero embeddings
masked out. That padding is exact in value: a masked text token reaches no other token (the
joint attention's key mask). It is not bitwise: the masked attention kernel sums in another
order than the unmasked one, so a graphed forward equals the eager one up to float rounding
(tests/gpu check both).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from omni_common.runtime.compile_cache import compile_cache_dir
from omni_common.runtime.cuda_graphs import CudaGraphCache, Inputs, KeepDecisions

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
TEXT_BUCKETS = (32, 64, 128, 256, 512, 1024)

ImgShapes = list[list[tuple[int, int, int]]]
# The transformer call of QwenImagePipeline's loop, on named inputs (denoise.transformer_forward).
Forward = Callable[[QwenImageTransformer2DModel, Inputs, ImgShapes], torch.Tensor]


def keep_decisions(transformer: QwenImageTransformer2DModel, device: torch.device) -> KeepDecisions | None:
    """Which buckets' graphs paid, in the compile cache (None without one), named by what
    decides it: the GPU, PyTorch and the transformer's architecture."""
    directory = compile_cache_dir()
    if directory is None:
        return None
    what = json.dumps(
        [torch.cuda.get_device_name(device), torch.__version__, dict(transformer.config)],
        sort_keys=True,
        default=str,
    )
    return KeepDecisions(directory / f"cuda-graphs-{hashlib.sha256(what.encode()).hexdigest()[:16]}.json")


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
    if batch > rows:
        padded = {
            name: torch.cat([value, value[:1].expand(batch - rows, *value.shape[1:])])
            for name, value in padded.items()
        }
    return padded


@contextlib.contextmanager
def capturable_text_mask() -> Iterator[None]:
    """While capturing, swap diffusers' `compute_text_seq_len_from_mask` for one without its
    per-sample lengths.

    diffusers 0.42 builds those lengths with `torch.as_tensor(int, device=...)`, a host to
    device copy that a CUDA graph capture refuses; QwenImageTransformer2DModel.forward
    discards them (it keeps the sequence length and the bool mask, which this returns the
    same). tests/unit/models/test_qwenimage_graphs.py pins that the forward is unchanged.
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
        self.cache = CudaGraphCache(
            device, max_graphs=max_graphs, decisions=keep_decisions(transformer, device)
        )

    def __call__(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        img_shapes: ImgShapes,
        modulation: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        rows, image_tokens = latents.shape[:2]
        length = embeds.shape[1]
        batch, text = bucket(rows, BATCH_BUCKETS), bucket(length, TEXT_BUCKETS)
        if batch is None or text is None:
            return None
        masked = mask is not None
        # Whether a replay pays is decided once per text bucket (decision_key): prompts of
        # 17 and 23 tokens replay alike, and a new length must not time its graph again.
        decision_key = (
            batch,
            text,
            masked,
            image_tokens,
            img_shapes[0][0],
            latents.dtype,
            modulation is not None,
        )
        key = decision_key if masked else (*decision_key, length)
        if not masked:
            text = length
        speedup = self.cache.speedup(key)
        if speedup is not None and speedup * rows < batch:
            # The padded rows would cost more than the replay saves (compute-bound shapes):
            # 3 requests at 1024x1024 run as 3, not as a replay of 4.
            return None
        inputs = padded_inputs(latents, timestep, embeds, mask, batch, text, modulation)
        shapes = [img_shapes[0]] * batch

        def run(static: Inputs) -> torch.Tensor:
            with capturable_text_mask():
                return self.forward(self.transformer, static, shapes)

        output = self.cache.run(key, inputs, run, decision_key=decision_key)
        return None if output is None else output[:rows]

    def capture(
        self, rows: int, img_shape: tuple[int, int, int], text: int, dtype: torch.dtype, *, masked: bool
    ) -> None:
        """Capture (and compile) the graph of `rows` requests at one image shape (frames,
        patch rows, patch columns) ahead of the first request: `masked`, the bucket of
        prompts padded to `text` tokens; otherwise prompts of exactly `text` tokens."""
        frames, height, width = img_shape
        channels = self.transformer.config["in_channels"]
        dim = self.transformer.config["joint_attention_dim"]
        mask = torch.ones((rows, text), dtype=torch.long, device=self.device) if masked else None
        modulation = None
        if self.modulation_width is not None:
            modulation = torch.zeros((rows, self.modulation_width), dtype=dtype, device=self.device)
        self(
            torch.zeros((rows, frames * height * width, channels), dtype=dtype, device=self.device),
            torch.full((rows,), 1000.0, dtype=dtype, device=self.device),
            torch.zeros((rows, text, dim), dtype=dtype, device=self.device),
            mask,
            [[img_shape]] * rows,
            modulation,
        )
