"""The graphed decode's attention (graphed_decode.py, graphed_extend.py): a transformers
attention function that runs transformers' SDPA for prefills and, for a recorded step, one call
over every row, each row reading only its own tokens (FlexAttention with a block mask, or a
padded SDPA with a mask)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

log = logging.getLogger("omnistage.graphed_decode")

GRAPHED_ATTENTION = "omnistage_graphed_rows"
ATTENTION = ("flex", "padded")  # "padded": one masked SDPA over the full capacity (measurement)
KV_BLOCK = 128  # FlexAttention's KV block: a row reads ceil(length / 128) blocks
# flex_attention's GPU kernels take heads of at least 16 channels (torch 2.11: "NYI" below, at
# the compile); a smaller head (the tiny test fixtures' 8) runs "padded" instead.
FLEX_MIN_HEAD_DIM = 16


def attention_for(attention: str, head_dim: int, device: torch.device) -> str:
    """The graphed decode's attention for heads of `head_dim` channels on `device`."""
    if attention == "flex" and device.type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
        log.info("graphed decode: heads of %d channels, padded attention (flex needs 16)", head_dim)
        return "padded"
    return attention


_flex: Callable[..., Any] | None = None


def _compiled_flex() -> Callable[..., Any]:
    """flex_attention compiled once per process (its eager form is a reference, not a kernel)."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _flex


def graphed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    row_attention: RowAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: with `row_attention` (a graphed decode step: `key`
    and `value` are the rows' whole buffers), each row attends to its own tokens in one call;
    otherwise transformers' SDPA (prefills)."""
    if row_attention is None:  # a prefill: transformers' SDPA
        past = key.shape[2] - query.shape[2]
        if attention_mask is None and past > 0:
            # After cached tokens (a reused prefix, an earlier chunk): SDPA's causal flag would
            # align the mask top-left, so the queries' offset is spelled out.
            attention_mask = torch.ones(
                query.shape[2], key.shape[2], dtype=torch.bool, device=query.device
            ).tril(past)[None, None]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scale = cast(float, getattr(module, "scaling", query.shape[-1] ** -0.5))
    if row_attention.kind == "flex" and row_attention.splits > 1:
        out = _split_flex(query, key, value, row_attention, scale)
    elif row_attention.kind == "flex":
        out = _compiled_flex()(
            query, key, value, block_mask=row_attention.block_mask, scale=scale, enable_gqa=True
        )
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=row_attention.padded_mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


def _split_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row_attention: RowAttention, scale: float
) -> torch.Tensor:
    """FlexAttention split over the row's keys: each query head repeated `splits` times, copy s
    reading split s of the row's blocks (the block mask's heads say which), then the copies
    combined by their log-sum-exps. flex's main kernel runs a block per (query block, head),
    so a few queries over a long row would otherwise leave most of the GPU idle, walking the
    row in turn; its split-KV kernel takes only a power of two of query heads a KV head."""
    from torch.nn.attention.flex_attention import AuxRequest

    batch, heads, length, dim = query.shape
    groups, splits = key.shape[1], row_attention.splits
    group = heads // groups
    repeated = query.view(batch, groups, 1, group, length, dim).expand(-1, -1, splits, -1, -1, -1)
    out, aux = _compiled_flex()(
        repeated.reshape(batch, groups * splits * group, length, dim),
        key,
        value,
        block_mask=row_attention.block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
    )
    # Split 0 holds the row's first key, which every query sees: no query's weights are all 0.
    weights = torch.softmax(aux.lse.view(batch, groups, splits, group, length).float(), dim=2)
    parts = out.view(batch, groups, splits, group, length, dim).float()
    combined = (parts * weights.unsqueeze(-1)).sum(dim=2)
    return combined.reshape(batch, heads, length, dim).to(query.dtype)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of GRAPHED_ATTENTION: decode steps mask per row themselves; prefills
    (one request, causal, no padding) need none from transformers either: SDPA's causal flag,
    or `graphed_attention`'s causal mask after cached tokens."""
    return None


@dataclass(eq=False)
class RowAttention:
    """What `graphed_attention` reads in one step: the rows' block mask (flex) or padded mask;
    `splits` > 1: flex over that many splits of the keys (`_split_flex`; the block mask's
    heads are the query heads x splits)."""

    kind: str
    block_mask: Any = None
    padded_mask: torch.Tensor | None = None
    splits: int = 1


def flex_rows(
    blocks: torch.Tensor,
    indices: torch.Tensor,
    mask_mod: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    queries: int,
    capacity: int,
    splits: int = 1,
) -> RowAttention:
    """FlexAttention's block mask over rows of `capacity` keys, for `queries` queries a row:
    query block q of row b reads the KV blocks `indices[b, 0, q, :blocks[b, 0, q]]` (KV_BLOCK
    tokens each, every one partial: `mask_mod` picks the keys within them). Built on the device
    from device tensors, so a recorded step builds it as it replays."""
    from torch.nn.attention.flex_attention import BlockMask

    options: dict[str, Any] = {"BLOCK_SIZE": KV_BLOCK, "mask_mod": mask_mod}
    options["seq_lengths"] = (queries, capacity)
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        options["compute_q_blocks"] = False  # only backward reads them
    block_mask = BlockMask.from_kv_blocks(blocks, indices, **options)
    return RowAttention("flex", block_mask=block_mask, splits=splits)


def causal_flex_rows(
    start: torch.Tensor, queries: int, capacity: int, heads: tuple[int, int, int]
) -> RowAttention:
    """FlexAttention for `queries` new tokens of one row of `capacity` keys after the `start`
    [1] it caches (a device tensor): each query sees the row up to its own position, reading
    only the blocks before it, in `heads` = (query heads, KV heads, splits) splits of them
    (`_split_flex`; 1: one pass)."""
    query_heads, groups, splits = heads
    device = start.device
    query_blocks = -(-queries // KV_BLOCK)
    ends = (torch.arange(1, query_blocks + 1, device=device) * KV_BLOCK).clamp(max=queries)
    block_count = capacity // KV_BLOCK
    blocks = ((start + ends + KV_BLOCK - 1) // KV_BLOCK).clamp(max=block_count)
    counts, indices = _split_blocks(blocks, query_heads, groups, splits, block_count)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        # Causal from the row's cached length. Which split reads a block is the block lists'
        # business alone: the kernels visit only the listed blocks (mask_mod indexing tensors
        # built in the same graph broke inductor's flex template: "XBLOCK is not defined").
        return kv <= start[b] + q

    return flex_rows(counts, indices, mask_mod, queries, capacity, splits)


def _split_blocks(
    blocks: torch.Tensor, heads: int, groups: int, splits: int, block_count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flex_rows`' blocks and indices for one row read in `splits` splits (`_split_flex`):
    from `blocks` [query blocks] (how many of the row's first blocks each query block reads),
    per repeated head (heads x splits, in `_split_flex`'s order) and query block, the
    contiguous share of those blocks its split reads ([1, heads x splits, query blocks] and
    [1, heads x splits, query blocks, block_count])."""
    group = heads // groups
    device = blocks.device
    split = torch.arange(groups * splits * group, device=device) // group % splits
    share = (blocks + splits - 1) // splits
    first = split.view(-1, 1) * share.view(1, -1)
    counts = torch.minimum((blocks.view(1, -1) - first).clamp(min=0), share.view(1, -1))
    indices = (first.unsqueeze(-1) + torch.arange(block_count, device=device)).clamp(max=block_count - 1)
    return counts.to(torch.int32).unsqueeze(0), indices.to(torch.int32).unsqueeze(0)


def use_graphed_attention(text_model: Any) -> None:
    """Make a transformers decoder attend through `graphed_attention` (registered process-wide
    under GRAPHED_ATTENTION): SDPA for its prefills, rows for graphed steps."""
    AttentionInterface.register(GRAPHED_ATTENTION, graphed_attention)
    AttentionMaskInterface.register(GRAPHED_ATTENTION, _no_mask)
    text_model.set_attn_implementation(GRAPHED_ATTENTION)
