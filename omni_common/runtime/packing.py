"""Weights packed into one byte buffer: many tensors moved with one large copy.

A model's weights are thousands of tensors; copying them one by one between host and
device pays an allocation and a launch per tensor. Packed, they are one pinned host buffer
and one copy, at the link's full bandwidth, and each tensor becomes a view of the buffer.
Layerwise offload packs each block; sleep level 1 packs a whole stage, in chunks, so that
allocating chunk i+1 on the device overlaps copying chunk i (allocating 40 GB at once costs
a tenth of a second before the first byte moves).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

_ALIGN = 256  # byte alignment of each tensor inside a packed buffer (any dtype can view it)
CHUNK_BYTES = 512 * 1024 * 1024

Packed = tuple[torch.Tensor, list["PackedTensor"]]  # a host byte buffer and its layout


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a packed buffer: the tensor object whose data it is, and where."""

    tensor: torch.Tensor
    shape: torch.Size
    offset: int
    nbytes: int

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor's weights inside a packed byte buffer (host or device)."""
        raw = buffer[self.offset : self.offset + self.nbytes]
        return raw.view(self.tensor.dtype).view(self.shape)


def pack(tensors: Iterable[torch.Tensor], pin: bool) -> Packed:
    """Copy tensors (each once) into one (pinned) host byte buffer; the buffer and layout."""
    layout, size = [], 0
    for tensor in dict.fromkeys(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(PackedTensor(tensor, tensor.shape, size, nbytes))
        size += -(-nbytes // _ALIGN) * _ALIGN
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    for item in layout:
        source = item.tensor.detach().contiguous().view(-1).view(torch.uint8)
        host[item.offset : item.offset + item.nbytes].copy_(source)
    return host, layout


def pack_chunks(tensors: Iterable[torch.Tensor], pin: bool, chunk_bytes: int = CHUNK_BYTES) -> list[Packed]:
    """Tensors packed into buffers of about `chunk_bytes` (a larger tensor gets its own)."""
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in dict.fromkeys(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return [pack(group, pin) for group in groups if group]


def unpack(chunks: list[Packed], device: torch.device) -> None:
    """Put packed weights on `device`, a copy per chunk (the next chunk is allocated while
    the last one is still copying); each tensor becomes a view of its chunk."""
    for host, layout in chunks:
        buffer = host.to(device, non_blocking=True)
        for item in layout:
            item.tensor.data = item.view(buffer)
