"""Packed weights: tensors grouped into chunks, copied back as views, values unchanged."""

from __future__ import annotations

import torch

from omni_common.runtime.packing import pack_chunks, unpack


def test_chunks_group_tensors_up_to_the_chunk_size_and_never_split_one() -> None:
    small = [torch.randn(16) for _ in range(5)]  # 64 bytes each
    large = torch.randn(100)  # 400 bytes: more than a chunk, alone in its own
    chunks = pack_chunks([*small[:2], large, *small[2:], small[0]], pin=False, chunk_bytes=160)
    groups = [[item.tensor for item in layout] for _, layout in chunks]
    assert [len(group) for group in groups] == [2, 1, 2, 1]  # small[0] is packed once
    assert groups[1][0] is large


def test_unpacked_tensors_keep_their_values_dtypes_and_shapes() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(4).to(torch.bfloat16)]
    expected = [t.clone() for t in tensors]
    chunks = pack_chunks(tensors, pin=False, chunk_bytes=64)
    for tensor in tensors:
        tensor.data = torch.empty(0, dtype=tensor.dtype)
    unpack(chunks, torch.device("cpu"))
    for tensor, want in zip(tensors, expected, strict=True):
        assert tensor.dtype == want.dtype and torch.equal(tensor, want)
