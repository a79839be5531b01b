"""The graphed extend's FlexAttention (graphed_attention.causal_flex_rows, _split_flex): a few
new queries of one row after the tokens it caches, read in 1 to 4 splits of the row's blocks
and combined by their log-sum-exps, equal one SDPA over the row with the causal mask. On the
CPU with flex_attention's eager reference, which applies the mask function only (not the block
lists), so each split's keys are what the mask says: an empty split (4 splits of 3 blocks)
and queries past a block boundary included. The compiled kernels run on a GPU
(tests/gpu/test_graphed_extend_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from omni_common.models import graphed_attention
from omni_common.models.graphed_attention import causal_flex_rows
from omni_common.models.graphed_attention import graphed_attention as attend

HEADS, GROUPS, DIM, CAPACITY = 6, 2, 16, 512


class Module(torch.nn.Module):
    scaling = DIM**-0.5


@pytest.mark.parametrize(
    ("start", "queries", "splits"), [(300, 16, 4), (40, 200, 3), (0, 16, 2), (130, 7, 1)]
)
def test_split_row_attention_equals_one_masked_sdpa(
    start: int, queries: int, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphed_attention, "_flex", flex_attention)  # the eager reference
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
