"""The prefix KV cache: the longest stored prefix that leaves a token to compute wins, keys
tell media apart, the byte bound evicts the least recently used, and the counters count."""

from __future__ import annotations

import torch

from omni_common.models.prefix_cache import PrefixCache, PrefixEntry, prefix_key


def entry(length: int, rows: bool = True) -> PrefixEntry:
    kv = (torch.zeros(1, 1, length, 2),)  # 8 bytes a token for keys, 8 for values
    return PrefixEntry(length, kv, kv, torch.zeros(length, 1) if rows else None)


def keys_of(tokens: torch.Tensor, media: tuple[str, ...] = ()):
    return lambda n: prefix_key(tokens[:n], media)


def test_the_longest_prefix_shorter_than_the_prompt_is_found() -> None:
    tokens = torch.arange(10)
    cache = PrefixCache(1 << 20)
    for n in (3, 6, 10):
        cache.put(prefix_key(tokens[:n], ()), entry(n))
    found = cache.lookup(10, keys_of(tokens), rows=True)
    assert found is not None and found.length == 6  # 10 would leave nothing to compute
    other = torch.tensor([0, 1, 2, 9, 9, 9, 9, 9, 9, 9])
    found = cache.lookup(10, keys_of(other), rows=True)
    assert found is not None and found.length == 3
    assert cache.lookup(10, keys_of(torch.full((10,), 7)), rows=True) is None
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.tokens_reused, stats.entries) == (2, 1, 9, 3)


def test_the_same_tokens_with_other_media_do_not_match() -> None:
    tokens = torch.arange(8)
    cache = PrefixCache(1 << 20)
    cache.put(prefix_key(tokens[:4], ("clip-a",)), entry(4))
    assert cache.lookup(8, keys_of(tokens, ("clip-b",)), rows=False) is None
    assert cache.lookup(8, keys_of(tokens, ("clip-a",)), rows=False) is not None


def test_an_entry_without_rows_serves_only_text_replies() -> None:
    tokens = torch.arange(8)
    cache = PrefixCache(1 << 20)
    cache.put(prefix_key(tokens[:4], ()), entry(4, rows=False))
    assert cache.lookup(8, keys_of(tokens), rows=True) is None
    assert cache.lookup(8, keys_of(tokens), rows=False) is not None


def test_the_byte_bound_evicts_the_least_recently_used() -> None:
    tokens = torch.arange(20)
    size = entry(4).nbytes
    cache = PrefixCache(2 * size)
    cache.put(prefix_key(tokens[:4], ()), entry(4))
    cache.put(prefix_key(tokens[5:9], ()), entry(4))
    assert cache.lookup(5, keys_of(tokens), rows=True) is not None  # the first is now the newest
    cache.put(prefix_key(tokens[10:14], ()), entry(4))  # evicts the second
    assert cache.stats.entries == 2 and cache.stats.bytes == 2 * size
    assert cache.lookup(5, keys_of(tokens), rows=True) is not None
    cache.put("too-big", entry(100))
    assert cache.stats.entries == 2
    cache.clear()
    assert cache.stats.bytes == 0
