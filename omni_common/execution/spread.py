"""What a forward spread over the ranks of a group needs from torch.distributed, beneath
`models` (a family's spread attention) and `runtime` (sequence_parallel): how a size splits
over the ranks, the group of the forward under way as a family's code sees it, and an
all-to-all that starts in one place and is waited for in another.

The all-to-all is torch's functional collective called as its two ops, so a compiled forward
keeps the work between them: dynamo traces them where they are called, and the inductor
setting `overlap_collectives` turns on (waits sunk to their first use) leaves the start before
that work and the wait after it. On a GPU, NCCL then moves the tensors on its own stream while
the products between run on the forward's; eagerly the same two calls overlap the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class SpreadGroup(Protocol):
    """The ranks one forward is spread over: how many, this rank's place among them, and their
    torch.distributed process group."""

    size: int
    rank: int
    handle: Any


class Spread(Protocol):
    """The forward under way, as a family's spread attention reads it: its group (None while
    the forward runs on this rank alone) and each rank's share of the image tokens."""

    @property
    def group(self) -> SpreadGroup | None: ...

    @property
    def token_shares(self) -> list[int]: ...


def shares(total: int, parts: int) -> list[int]:
    """The sizes torch.tensor_split gives `parts` pieces of `total`."""
    return [len(piece) for piece in torch.arange(total).tensor_split(parts)]


def start_all_to_all(
    send: torch.Tensor, sent: list[int], received: list[int], group: SpreadGroup
) -> torch.Tensor:
    """Start an all-to-all of flat `send` (`sent[r]` elements, in rank order, go to rank r;
    `received[r]` come from it): returns the flat buffer it fills, for `finish` to wait on."""
    name = group.handle.group_name
    pending: torch.Tensor = torch.ops._c10d_functional.all_to_all_single(send, received, sent, name)
    return pending


def finish(
    pending: torch.Tensor, received: list[int], shapes: Sequence[tuple[int, ...]]
) -> list[torch.Tensor]:
    """Wait for `start_all_to_all`'s buffer and cut it into what each rank sent, shaped."""
    flat = torch.ops._c10d_functional.wait_tensor(pending)
    return [part.reshape(shape) for part, shape in zip(flat.split(received), shapes, strict=True)]


def exchange(
    pieces: list[torch.Tensor], incoming: list[tuple[int, ...]], group: SpreadGroup
) -> list[torch.Tensor]:
    """All-to-all of uneven pieces, waited for at once: `pieces[r]` goes to rank r; returns what
    each rank sent here, shaped as `incoming[r]`. One flat buffer each way (one collective)."""
    send = torch.cat([piece.reshape(-1) for piece in pieces])
    received = [math.prod(shape) for shape in incoming]  # sizes stay symbolic where they are
    pending = start_all_to_all(send, [piece.numel() for piece in pieces], received, group)
    return finish(pending, received, incoming)


def overlap_collectives() -> None:
    """Let inductor leave a collective's wait at its first use, so the compiled work between a
    start and its wait runs while the tensors move (process-wide: only the processes of a
    replica over several devices call it)."""
    import torch._inductor.config as inductor

    inductor.reorder_for_compute_comm_overlap = True
    inductor.reorder_for_compute_comm_overlap_passes = ["sink_waits"]
