"""The thinker's prefill head on the last position only (transformers' Qwen2.5-Omni thinker
ignores `logits_to_keep`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch


class LastPositionHead(torch.nn.Module):
    """An output head that runs on the last position only: transformers' Qwen2.5-Omni thinker
    ignores `logits_to_keep` and runs its head on every prompt token (a chunk of 512 at real
    size: a [512, 152064] product and its 156 MB of bf16 logits, of which a prefill reads one
    row)."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[:, -1:])


@contextmanager
def head_on_last_position(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """While a prefill's forward runs, `model.lm_head` computes the last position's logits only
    (when `enabled`)."""
    if not enabled:
        yield
        return
    head = cast(torch.nn.Module, model.lm_head)
    model.lm_head = LastPositionHead(head)
    try:
        yield
    finally:
        model.lm_head = head
