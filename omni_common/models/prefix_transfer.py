"""A kept prefix's KV as named tensors, so that a conversation's next turn can run on another
replica without computing its earlier turns again (the coordinator moves them by handle:
services/coordinator/prefix_move.py).

The names and meta are StageRequest.export_prefix's contract: "prefix.keys.<layer>" and
"prefix.values.<layer>" [1, kv_heads, length, head_dim], "prefix.rows" [length, H] when the
generator keeps what it streams of those tokens, meta "prefix.length" and "prefix.key" (the
prefix cache's content address of those tokens and media). A receiver checks the tensors
against its own model (`entry_of`: wrong layer count, shape or dtype is INVALID_ARGUMENT) and
installs the entry under the key only when its own prompt's first `length` tokens have that key:
a prefix of another prompt is not this one's, and the prompt is then computed in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omni_common.errors import InvalidArgument
from omni_common.models.base import StageState
from omni_common.models.prefix_cache import PrefixEntry

PREFIX = "prefix."
LENGTH = "prefix.length"
KEY = "prefix.key"
ROWS = "prefix.rows"


@dataclass(frozen=True)
class KvShape:
    """What a generator's prefix KV looks like: per layer [1, kv_heads, length, head_dim] of
    `dtype`, and rows [length, row_width]."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    row_width: int


def prefix_state(key: str, entry: PrefixEntry) -> StageState:
    """`entry` (kept under `key`) as an export's output."""
    tensors = {f"{PREFIX}keys.{i}": t for i, t in enumerate(entry.keys)}
    tensors |= {f"{PREFIX}values.{i}": t for i, t in enumerate(entry.values)}
    if entry.rows is not None:
        tensors[ROWS] = entry.rows
    return StageState(tensors=tensors, meta={LENGTH: str(entry.length), KEY: key})


def split_moved(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A call's inputs apart from a moved prefix's tensors, and those tensors."""
    moved = {name: t for name, t in tensors.items() if name.startswith(PREFIX)}
    return {name: t for name, t in tensors.items() if name not in moved}, moved


def entry_of(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], shape: KvShape, device: torch.device
) -> tuple[str, PrefixEntry]:
    """The moved prefix in `tensors`/`meta` as a cache entry on `device` (copies), with its key;
    INVALID_ARGUMENT when it does not fit a model of `shape`."""
    try:
        length = int(meta.get(LENGTH, ""))
    except ValueError:
        raise InvalidArgument(f"a moved prefix needs an integer {LENGTH!r} meta") from None
    key = meta.get(KEY, "")
    if length <= 0 or len(key) != 64:
        raise InvalidArgument(f"a moved prefix needs a positive {LENGTH!r} and a 64-hex {KEY!r}")
    expected = {f"{PREFIX}{kind}.{i}" for kind in ("keys", "values") for i in range(shape.layers)}
    names = set(tensors) - {ROWS}
    if names != expected:
        raise InvalidArgument(
            f"a moved prefix must hold keys and values of exactly {shape.layers} layers; "
            f"got {len(names)} tensors"
        )
    layer = (1, shape.kv_heads, length, shape.head_dim)
    for name in sorted(expected):
        _check(name, tensors[name], layer, shape.dtype)
    rows = tensors.get(ROWS)
    if rows is not None:
        _check(ROWS, rows, (length, shape.row_width), shape.dtype)
    keys = tuple(tensors[f"{PREFIX}keys.{i}"].to(device, copy=True) for i in range(shape.layers))
    values = tuple(tensors[f"{PREFIX}values.{i}"].to(device, copy=True) for i in range(shape.layers))
    kept = None if rows is None else rows.to(device, copy=True)
    return key, PrefixEntry(length, keys, values, kept)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got, want = (str(d).removeprefix("torch.") for d in (tensor.dtype, dtype))
        raise InvalidArgument(
            f"moved prefix tensor {name!r} is {list(tensor.shape)} {got}; the model's is {list(shape)} {want}"
        )


def kv_shape_of(text_config: object, dtype: torch.dtype) -> KvShape:
    """The KvShape of a transformers decoder of `text_config` (Qwen2-like: rows are as wide as
    its hidden states)."""
    config: Any = text_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KvShape(
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=dtype,
        row_width=config.hidden_size,
    )
