"""Prompt-embedding cache of the ar-encoder: one text's embeddings per entry, LRU, bounded in
bytes.

A key is (model, text, template, max_sequence_length): prompt and negative prompt are cached
separately, and the empty negative prompt like any other text. A hit returns a copy of the
tensor the miss produced, so hit and miss are bitwise equal (and a caller that writes into
its tensor cannot change the cache). Used from one event loop, so no lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("omnistage.ar_encoder.cache")


@dataclass(frozen=True)
class CacheKey:
    """What determines one text's embeddings on one service."""

    model: str  # the served model, its dtype and the backend
    text: str
    template: str
    max_sequence_length: int


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    bypassed: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int


def entry_bytes(key: CacheKey, tensor: torch.Tensor) -> int:
    """What an entry is charged: the tensor's bytes plus its text (the template is shared)."""
    return tensor.numel() * tensor.element_size() + len(key.text.encode())


class EmbeddingCache:
    """LRU of per-text embeddings, at most `max_bytes` in all (0 disables it)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("cache size must be >= 0 bytes")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.bypassed = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: CacheKey, *, bypass: bool = False) -> torch.Tensor | None:
        """A copy of the cached embeddings of `key`, or None (a miss). `bypass` looks nothing
        up (and counts as bypassed, not as a miss)."""
        if bypass:
            self.bypassed += 1
            return None
        tensor = self._entries.get(key) if self.enabled else None
        if tensor is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return tensor.clone()

    def put(self, key: CacheKey, tensor: torch.Tensor, *, bypass: bool = False) -> None:
        """Store a copy of `tensor` (on its device), evicting least recently used entries until the
        bound holds. An entry larger than the whole cache is not stored."""
        if bypass or not self.enabled:
            return
        size = entry_bytes(key, tensor)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= entry_bytes(key, old)
        self._entries[key] = tensor.detach().clone(memory_format=torch.contiguous_format)
        self._bytes += size
        while self._bytes > self.max_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self._bytes -= entry_bytes(evicted_key, evicted)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        return CacheStats(
            hits=self.hits,
            misses=self.misses,
            bypassed=self.bypassed,
            evictions=self.evictions,
            entries=len(self._entries),
            bytes=self._bytes,
            max_bytes=self.max_bytes,
        )

    def log_stats(self) -> None:
        s = self.stats()
        log.info(
            "prompt cache: %d hits, %d misses, %d bypassed, %d evictions, %d entries, %d of %d bytes",
            s.hits,
            s.misses,
            s.bypassed,
            s.evictions,
            s.entries,
            s.bytes,
            s.max_bytes,
        )
