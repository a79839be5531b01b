"""The graphed extend's FlexAttention (graphed_attention.causal_flex_rows, _split_flex): a few
new queries of one row after the tokens it caches, read in 1 to 4 splits of the row's blocks
and combined by their log-sum-exps, equal one SDPA over the row with the causal mask. On the
CPU with a reference that computes what flex's kernels do: the mask function inside the blocks
the block mask lists, nothing outside them (flex's eager form applies the mask function alone,
and the split of a row's blocks lives in the lists). An empty split (4 splits of 3 blocks) and
queries past a block boundary are included. The compiled kernels run on a GPU
(tests/gpu/test_graphed_extend_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omni_common.models import graphed_attention
from omni_common.models.graphed_attention import causal_flex_rows
from omni_common.models.graphed_attention import graphed_attention as attend

HEADS, GROUPS, DIM, CAPACITY = 6, 2, 16, 512


class Module(torch.nn.Module):
    scaling = DIM**-0.5


def listed_blocks_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: Any,
    scale: float,
    enable_gqa: bool,
    return_aux: Any = None,
) -> Any:
    """flex_attention as its kernels compute it: the mask function within the listed blocks."""
    assert enable_gqa
    _, heads, length, _ = query.shape
    capacity = key.shape[-2]
    q_block, kv_block = block_mask.BLOCK_SIZE
    listed = block_mask.to_dense().bool().repeat_interleave(q_block, 2).repeat_interleave(kv_block, 3)
    b, h, q, kv = (
        torch.arange(n).view(*[-1 if i == d else 1 for i in range(4)])
        for d, n in enumerate((1, heads, length, capacity))
    )
    allowed = listed[:, :, :length, :capacity] & block_mask.mask_mod(b, h, q, kv)
    key, value = (t.repeat_interleave(heads // t.shape[1], 1) for t in (key, value))
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ value
    if return_aux is None:
        return out
    return out, SimpleNamespace(lse=torch.logsumexp(scores, -1))


@pytest.mark.parametrize(
    ("start", "queries", "splits"), [(300, 16, 4), (40, 200, 3), (0, 16, 2), (130, 7, 1)]
)
def test_split_row_attention_equals_one_masked_sdpa(
    start: int, queries: int, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphed_attention, "_flex", listed_blocks_flex)
    generator = torch.Generator().manual_seed(start + queries)
    query = torch.randn(1, HEADS, queries, DIM, generator=generator)
    key, value = torch.randn(2, 1, GROUPS, CAPACITY, DIM, generator=generator)
    rows = causal_flex_rows(torch.tensor([start]), queries, CAPACITY, (HEADS, GROUPS, splits))
    assert rows.splits == splits
    out, _ = attend(Module(), query, key, value, None, row_attention=rows)
    positions = start + torch.arange(queries)
    mask = torch.arange(CAPACITY).view(1, -1) <= positions.view(-1, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=Module.scaling, enable_gqa=True
    )
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
