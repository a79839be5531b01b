"""graphed_attention.pad_groups / unpad_groups: query heads padded to a power of two per KV
group (for flex_attention's split-KV kernel) attend as before, each real head to its own KV
head, and the padding leaves nothing in the output; shapes the kernel could not tile stay as
they are."""

from __future__ import annotations

import pytest
import torch

from omni_common.models.graphed_attention import KV_BLOCK, pad_groups, unpad_groups


@pytest.mark.parametrize(("heads", "groups", "length"), [(28, 4, 16), (6, 2, 5), (3, 1, 1), (12, 4, 32)])
def test_padded_groups_attend_as_the_real_heads(heads: int, groups: int, length: int) -> None:
    generator = torch.Generator().manual_seed(heads)
    query = torch.randn(1, heads, length, 16, generator=generator, dtype=torch.float64)
    key, value = torch.randn(2, 1, groups, 40, 16, generator=generator, dtype=torch.float64)
    mask = torch.rand(1, 1, length, 40, generator=generator) < 0.7
    mask[..., 0] = True  # every query sees a key
    padded = pad_groups(query, groups)
    group = heads // groups
    wanted_heads = groups * (1 << (group - 1).bit_length())
    assert padded.shape[1] == wanted_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        padded, key, value, attn_mask=mask, enable_gqa=True
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(unpad_groups(out, groups, heads), expected, rtol=0, atol=1e-12)


def test_groups_a_power_of_two_or_too_many_queries_are_not_padded() -> None:
    query = torch.randn(1, 28, KV_BLOCK // 8 + 1, 16)  # 8 x 17 queries: past one query block
    assert pad_groups(query, 4) is query
    query = torch.randn(1, 16, 4, 16)  # 4 a KV head already
    assert pad_groups(query, 4) is query
    assert unpad_groups(query, 4, 16) is query
