"""Step caching for the Qwen-Image DiT, opt in per request (the "step_cache" option): a
first-block cache.

Between neighbouring denoising steps the transformer's output changes little, and how much
shows already in its first block. So every step runs the preamble and block 0 for every row;
then, per request, block 0's image residual (its output minus its input) is compared with the
one that request had at its last fully computed step, by relative L1 distance
mean|r - r_prev| / mean|r_prev|. Below the request's threshold, blocks 1..N-1 are skipped for
it and their effect is taken from that step: block 0's output plus the cached tail residual
(the last block's image output minus block 0's). Otherwise blocks 1..N-1 run, for the
requests that miss only, and refresh their caches. A hit is approximate by design.

With every request missing, the noise prediction is bitwise QwenImageTransformer2DModel's:
`_preamble` and the block loop are its forward's ops in its order (diffusers 0.42;
tests/unit/models/qwenimage/test_step_cache.py pins it).

Costs: the decision reads the distances on the host, one small device sync per step (the
host waits for block 0, so the step scheduler's launch-ahead overlap is lost on these steps).
Block 0 runs apart from the later blocks, which replay as a CUDA graph of their own where a
GPU stage keeps graphs (GraphedTransformer.replay_part, bucketed and padded as the forward's
graphs are): the rows that run them change from step to step, so the whole forward's graphs
do not serve.
That is why the cache is a batch key: uncached requests keep theirs.
Measured on one H100 (Qwen-Image's DiT at full size with random weights, 60 blocks, bf16,
1024x1024, eager): a computed step 182 ms, as the plain forward; a reused one 5.0 ms.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenImageTransformer2DModel,
    compute_text_seq_len_from_mask,
)

from omni_common.errors import FailedPrecondition, Unimplemented
from omni_common.execution.cuda_graphs import Inputs
from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.graphs import GraphedTransformer, ImgShapes

OPTION = "step_cache"
log = logging.getLogger("omnistage.step_cache")


@dataclass
class StepCache:
    """One request's first-block cache, on its denoise state.

    The residuals are device tensors of the image stream's size, [rows, image tokens, inner
    dim] in the model dtype (2 rows with true CFG): for Qwen-Image at 1024x1024 in bf16, 4096
    x 3072 x 2 bytes = 25 MB per row, each. `drop` frees them when the request leaves.
    """

    threshold: float  # relative L1 distance below which a step reuses the tail; > 0
    first_residual: torch.Tensor | None = None  # block 0's, at the last computed step
    tail_residual: torch.Tensor | None = None  # blocks 1..N-1's, at the same step
    steps: int = 0  # forwards run through this cache
    cached_steps: int = 0  # of those, the ones that reused the tail

    def drop(self) -> None:
        self.first_residual = self.tail_residual = None


def step_cache_threshold(request: GenerationRequest) -> float:
    """The request's "step_cache" option (the family validated its range); 0 is off."""
    return float(request.option(OPTION, "0"))


def check_cacheable(transformer: QwenImageTransformer2DModel) -> None:
    """Whether this transformer may skip its later blocks.

    zero_cond_t models (the edit variants) double the timestep embedding and modulate per
    token; the cached forward takes one embedding per row. Layerwise offload
    (omni_common/runtime/layerwise_offload.py) fetches block i + 1 in block i's pre-hook and expects
    the blocks to run round in a cycle: a step that stops after block 0 leaves block 1 in a
    slot that the next step's fetches overwrite while it is still to run (seen on the tiny
    model: latents off by 5e-2). Its hooks are the only forward hooks on the blocks (torch
    keeps them in a private dict; it has no public accessor).
    """
    if transformer.config.get("zero_cond_t", False):
        raise Unimplemented(f"option {OPTION} is not supported for zero_cond_t Qwen-Image models")
    if any(block._forward_pre_hooks for block in transformer.transformer_blocks):
        raise FailedPrecondition(
            f"option {OPTION} cannot be used here: this stage offloads the DiT's blocks layerwise, "
            "which needs every block to run every step; leave the option out"
        )


def log_reuse(cache: StepCache, request: GenerationRequest) -> None:
    log.info(
        "request %dx%d seed %d: step cache reused %d of %d steps",
        request.width,
        request.height,
        request.seed,
        cache.cached_steps,
        cache.steps,
    )


@dataclass
class _Preamble:
    """What every block takes: the embedded streams, the text mask, the timestep embedding
    and the RoPE frequencies (shared by all rows)."""

    hidden: torch.Tensor
    encoder: torch.Tensor
    mask: torch.Tensor | None
    temb: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]

    def rows(self, index: torch.Tensor) -> _Preamble:
        """The same for the batch rows `index` (copies; the RoPE frequencies are shared)."""
        mask = None if self.mask is None else self.mask.index_select(0, index)
        return _Preamble(
            self.hidden.index_select(0, index),
            self.encoder.index_select(0, index),
            mask,
            self.temb.index_select(0, index),
            self.rope,
        )


def _preamble(transformer: QwenImageTransformer2DModel, inputs: Inputs, img_shapes: ImgShapes) -> _Preamble:
    """QwenImageTransformer2DModel.forward up to its block loop, op for op (no guidance, no
    additional_t_cond, no zero_cond_t), on execution.transformer_forward's inputs ("modulation"
    included)."""
    hidden = transformer.img_in(inputs["latents"])
    # Packed modulation rows (modulation.py) stand in for the timestep where the stage keeps them.
    timestep = (
        inputs["modulation"] if "modulation" in inputs else (inputs["timestep"] / 1000).to(hidden.dtype)
    )
    encoder = transformer.txt_norm(inputs["embeds"])
    encoder = transformer.txt_in(encoder)
    text_seq_len, _, mask = compute_text_seq_len_from_mask(encoder, inputs.get("mask"))
    temb = transformer.time_text_embed(timestep, hidden, None)
    rope = transformer.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hidden.device)
    return _Preamble(hidden, encoder, mask, temb, rope)


def _blocks(
    transformer: QwenImageTransformer2DModel, start: int, stop: int, pre: _Preamble
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks start..stop-1 from `pre`'s streams: (encoder, hidden) as the blocks return them."""
    encoder, hidden = pre.encoder, pre.hidden
    for block in transformer.transformer_blocks[start:stop]:
        encoder, hidden = block(
            hidden_states=hidden,
            encoder_hidden_states=encoder,
            encoder_hidden_states_mask=pre.mask,
            temb=pre.temb,
            image_rotary_emb=pre.rope,
            joint_attention_kwargs={},
            modulate_index=None,
        )
    return encoder, hidden


def _later_blocks(
    transformer: QwenImageTransformer2DModel,
    after0: _Preamble,
    img_shapes: ImgShapes,
    graphs: GraphedTransformer | None,
) -> torch.Tensor:
    """Blocks 1..N-1's image stream from block 0's streams `after0`: replayed as a graph of
    their own where `graphs` keeps graphs (padded prompts, as the forward's graphs pad them),
    else run as they are."""
    blocks = len(transformer.transformer_blocks)
    if graphs is not None:
        streams = {"hidden": after0.hidden, "encoder": after0.encoder, "temb": after0.temb}
        if after0.mask is not None:
            streams["mask"] = after0.mask

        def part(static: Inputs, shapes: ImgShapes) -> torch.Tensor:
            text = static["encoder"].shape[1]
            rope = transformer.pos_embed(shapes, max_txt_seq_len=text, device=static["hidden"].device)
            mask = static["mask"].to(torch.bool) if "mask" in static else None
            pre = _Preamble(static["hidden"], static["encoder"], mask, static["temb"], rope)
            return _blocks(transformer, 1, blocks, pre)[1]

        replayed = graphs.replay_part("step-cache-later-blocks", streams, img_shapes, part)
        if replayed is not None:
            return replayed
    return _blocks(transformer, 1, blocks, after0)[1]


def _hits(first_residual: torch.Tensor, caches: Sequence[StepCache], compute: Sequence[bool]) -> list[bool]:
    """Per request: whether its block-0 residual moved less than its threshold since its last
    computed step. Request i's rows are i, i + n, ... (n requests). One device sync."""
    n = len(caches)
    compared = [i for i, cache in enumerate(caches) if cache.first_residual is not None and not compute[i]]
    if not compared:
        return [False] * n
    distances = []
    for i in compared:
        previous = caches[i].first_residual
        assert previous is not None
        change = (first_residual[i::n] - previous).abs().mean(dtype=torch.float32)
        distances.append(change / previous.abs().mean(dtype=torch.float32))
    # NaN (a zero previous residual) compares False: the request computes.
    below = dict(zip(compared, torch.stack(distances).tolist(), strict=True))
    return [i in below and below[i] < cache.threshold for i, cache in enumerate(caches)]


def cached_forward(
    transformer: QwenImageTransformer2DModel,
    inputs: Inputs,
    img_shapes: ImgShapes,
    caches: Sequence[StepCache],
    compute: Sequence[bool],
    graphs: GraphedTransformer | None = None,
) -> torch.Tensor:
    """execution.transformer_forward with a first-block cache per request; the later blocks
    replay as CUDA graphs through `graphs` where it pays (_later_blocks).

    The batch holds len(caches) requests; its rows are all requests' first rows, then all
    their second rows (CFG: conditional, then unconditional), so request i owns rows i, i + n,
    ... `compute[i]` forces request i to run every block (its last step). A request with no
    cached residual yet (its first step, or the first after a restore) computes too. The
    caches are updated only after every block has run, so a step that raises leaves them as
    they were (the step scheduler retries failed steps one request at a time).
    """
    n, rows = len(caches), inputs["latents"].shape[0]
    if n == 0 or rows % n or len(compute) != n:
        raise ValueError(f"{rows} rows do not split into {n} requests with {len(compute)} flags")
    pre = _preamble(transformer, inputs, img_shapes)
    encoder0, hidden0 = _blocks(transformer, 0, 1, pre)
    first_residual = hidden0 - pre.hidden
    hits = _hits(first_residual, caches, compute)
    missing = [row for row in range(rows) if not hits[row % n]]
    after0 = _Preamble(hidden0, encoder0, pre.mask, pre.temb, pre.rope)
    # No selection: bitwise the plain forward (eagerly; on an H200 the graphed later blocks gave
    # the uncached request's image bit for bit, docs/benchmarks.md).
    if len(missing) == rows:
        hidden = _later_blocks(transformer, after0, img_shapes, graphs)
        tail_residual = hidden - hidden0
    else:
        hidden = hidden0.clone()
        for row in range(rows):
            if hits[row % n]:
                tail = caches[row % n].tail_residual
                assert tail is not None
                hidden[row] += tail[row // n]
        if missing:
            index = torch.tensor(missing, device=hidden0.device)
            shapes = [img_shapes[row] for row in missing]
            computed = _later_blocks(transformer, after0.rows(index), shapes, graphs)
            hidden.index_copy_(0, index, computed)
        tail_residual = hidden - hidden0  # read only on the rows that computed
    output = transformer.proj_out(transformer.norm_out(hidden, pre.temb))
    for i, cache in enumerate(caches):
        cache.steps += 1
        if hits[i]:
            cache.cached_steps += 1
        else:
            cache.first_residual = first_residual[i::n].clone()
            cache.tail_residual = tail_residual[i::n].clone()
    return output
