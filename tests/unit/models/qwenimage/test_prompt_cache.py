"""The ar-encoder's prompt-embedding cache: a hit is bitwise the miss, the byte bound holds,
counters count, bypass skips it, and the empty negative prompt is cached like any text."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_common.models.base import GenerationRequest
from omni_common.models.qwenimage.encode import PROMPT_TEMPLATE, QwenImageEncoder
from omni_common.models.qwenimage.prompt_cache import CacheKey, EmbeddingCache, entry_bytes
from omni_common.models.qwenimage.prompt_encoder import PromptEncoder, TorchBackend


def key(text: str, length: int = 512) -> CacheKey:
    return CacheKey("m:float32:torch", text, PROMPT_TEMPLATE, length)


async def _inline(fn: Callable[..., Any], *args: object) -> Any:
    return fn(*args)


def prompt_encoder(model: Path, cache_bytes: int) -> PromptEncoder:
    encoder = QwenImageEncoder.load(model, torch.device("cpu"), torch.float32)
    backend = TorchBackend(encoder, _inline, window_s=0.0, max_batch=8, max_queue=64)
    return PromptEncoder(backend, EmbeddingCache(cache_bytes), "tiny:float32:torch")


def test_eviction_keeps_the_byte_bound_and_drops_least_recently_used() -> None:
    tensor = torch.zeros(10, 16)  # 640 bytes + the text
    size = entry_bytes(key("a"), tensor)
    cache = EmbeddingCache(max_bytes=3 * size)
    for text in "abc":
        cache.put(key(text), tensor)
    assert cache.get(key("a")) is not None  # "a" is now the most recently used
    cache.put(key("d"), tensor)
    assert cache.nbytes <= cache.max_bytes and len(cache) == 3
    assert cache.get(key("b")) is None  # the least recently used went first
    assert all(cache.get(key(t)) is not None for t in "acd")
    assert cache.stats().evictions == 1
    cache.put(key("huge"), torch.zeros(1000, 16))  # larger than the whole cache: not stored
    assert cache.get(key("huge")) is None and cache.nbytes <= cache.max_bytes
    for i in range(50):
        cache.put(key(f"t{i}"), torch.zeros(i % 7 + 1, 16))
        assert cache.nbytes <= cache.max_bytes
        assert cache.nbytes == sum(entry_bytes(k, v) for k, v in cache._entries.items())


def test_counters_bypass_and_disabled_cache() -> None:
    cache = EmbeddingCache(max_bytes=1 << 20)
    assert cache.get(key("x")) is None
    cache.put(key("x"), torch.ones(2, 2))
    assert cache.get(key("x")) is not None
    assert cache.get(key("x"), bypass=True) is None
    cache.put(key("y"), torch.ones(2, 2), bypass=True)
    s = cache.stats()
    assert (s.hits, s.misses, s.bypassed, s.entries) == (1, 1, 1, 1)
    assert cache.get(key("x", length=64)) is None  # max_sequence_length is part of the key
    off = EmbeddingCache(max_bytes=0)
    off.put(key("x"), torch.ones(2, 2))
    assert off.get(key("x")) is None and len(off) == 0
    with pytest.raises(ValueError):
        EmbeddingCache(max_bytes=-1)


def test_hit_returns_a_copy_the_caller_cannot_corrupt() -> None:
    cache = EmbeddingCache(max_bytes=1 << 20)
    cache.put(key("x"), torch.ones(2, 2))
    cache.get(key("x")).mul_(0)  # type: ignore[union-attr]
    assert torch.equal(cache.get(key("x")), torch.ones(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_hit_equals_miss_bitwise(tiny_model: Path, cfg: bool) -> None:
    encoder = prompt_encoder(tiny_model, 1 << 20)
    request = GenerationRequest(
        prompt="a red cat sitting on a blue mat",
        negative_prompt=" " if cfg else "",
        true_cfg_scale=4.0 if cfg else 1.0,
        max_sequence_length=512,
    )

    async def twice() -> tuple[Any, Any, Any]:
        miss = await encoder.encode(request)
        hit = await encoder.encode(request)
        fresh = await encoder.encode(request, bypass_cache=True)
        return miss, hit, fresh

    miss, hit, fresh = asyncio.run(twice())
    n = 2 if cfg else 1
    assert set(hit.tensors) == set(miss.tensors) and len(hit.tensors) == n
    for name in miss.tensors:
        assert torch.equal(hit.tensors[name], miss.tensors[name])
        assert torch.equal(fresh.tensors[name], miss.tensors[name])
    # The family's own runner (bitwise diffusers' pipeline) gives the same tensors.
    reference = encoder.backend.encoder.encode([request])[0]  # type: ignore[attr-defined]
    for name in miss.tensors:
        assert torch.equal(hit.tensors[name], reference.tensors[name])
    stats = encoder.cache.stats()
    # The empty negative prompt " " is cached like the prompt: the second call hits both.
    assert (stats.misses, stats.hits, stats.bypassed, stats.entries) == (n, n, n, n)


def test_batched_requests_share_cached_texts(tiny_model: Path) -> None:
    encoder = prompt_encoder(tiny_model, 1 << 20)
    requests = [
        GenerationRequest(prompt=p, negative_prompt=" ", true_cfg_scale=4.0)
        for p in ("a red cat", "a blue dog", "a red cat")
    ]

    async def together() -> list[Any]:
        return list(await asyncio.gather(*(encoder.encode(r) for r in requests)))

    first = asyncio.run(together())
    second = asyncio.run(together())
    for a, b in zip(first, second, strict=True):
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name])
    assert encoder.cache.stats().hits >= 6  # the second round is all hits
