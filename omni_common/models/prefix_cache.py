"""The KV of prompts' prefixes a generator computed before, kept for the next request that
starts with the same tokens: a conversation's next turn re-sends every earlier turn, and pays
only for what it adds (SGLang's radix cache and vLLM's prefix caching do the same at block
granularity; here a whole prefix is one entry, which is what a conversation needs).

- **Content-addressed**: an entry's key is a hash of its token ids and of the content addresses
  (sha256 digests) of the media whose placeholders lie in it: two audio clips of the same length
  expand to the same placeholder tokens, so tokens alone would confuse them.
- **Byte-bounded, LRU**: entries are copies (a generator's slots are reused as soon as a
  request ends); adding one evicts the least recently used until the total fits `max_bytes`.
- **Longest match**: a request looks up the longest stored prefix of its own tokens that leaves
  at least one token to compute (the prefill's last position gives the first token's logits).

A generator keeps entries at two boundaries: its prompt (at prefill) and its prompt plus the
reply tokens it fed (at finish), so the next turn hits the longer one when its history re-tokenizes
to the same reply tokens, and the prompt when it does not.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_MAX_BYTES = 1 << 30


@dataclass(frozen=True, eq=False)
class PrefixEntry:
    """A prefix's cache: per layer keys and values [1, kv_heads, length, head_dim], plus what
    the generator streams of those tokens (`rows`, e.g. the thinker's talker rows [length, H])."""

    length: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    rows: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *([] if self.rows is None else [self.rows])]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefixStats:
    """Counters for metrics: lookups that found a prefix, lookups that did not, the tokens hits
    did not compute, and what the cache holds now."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    entries: int = 0
    bytes: int = 0


def prefix_key(tokens: torch.Tensor, media: Sequence[str]) -> str:
    """The content address of a prefix: its token ids [n] and its media's digests, in order."""
    digest = hashlib.sha256(tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    for item in media:
        digest.update(b"|" + item.encode())
    return digest.hexdigest()


class PrefixCache:
    """Prefix entries by content address, at most `max_bytes` in all (0 turns it off)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._reused = 0

    def lookup(self, length: int, key_of: Callable[[int], str], *, rows: bool) -> PrefixEntry | None:
        """The longest entry shorter than `length` whose key is `key_of(its length)` (and that
        has rows, when `rows`); it becomes the most recently used. Counted as a hit or a miss."""
        found = self.peek(length, key_of, rows=rows)
        if found is None:
            self._misses += 1
            return None
        key, entry = found
        self._entries.move_to_end(key)
        self._hits += 1
        self._reused += entry.length
        return entry

    def peek(
        self, length: int, key_of: Callable[[int], str], *, rows: bool
    ) -> tuple[str, PrefixEntry] | None:
        """`lookup`'s entry and its key, neither counted nor made the most recently used (an
        export for another replica: this one's prefill did not reuse it)."""
        lengths = sorted(
            {entry.length for entry in self._entries.values() if entry.length < length}, reverse=True
        )
        for candidate in lengths:
            key = key_of(candidate)
            entry = self._entries.get(key)
            if entry is not None and (entry.rows is not None or not rows):
                return key, entry
        return None

    def put(self, key: str, entry: PrefixEntry) -> None:
        """Keep `entry` under `key` (a copy the caller no longer writes), evicting LRU entries
        until it fits; one larger than the whole budget is not kept."""
        if entry.nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._entries and self._bytes + entry.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
        self._entries[key] = entry
        self._bytes += entry.nbytes

    def clear(self) -> None:
        """Drop every entry (weights changed: the cached KV no longer holds)."""
        self._entries.clear()
        self._bytes = 0

    @property
    def stats(self) -> PrefixStats:
        return PrefixStats(self._hits, self._misses, self._reused, len(self._entries), self._bytes)
