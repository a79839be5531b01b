"""The coordinator's step cache: content-addressed, byte-bounded LRU, aged out before the
producers' leases end, and never releasing an entry a request still reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omni_common.transport import TensorTransport
from omnistage.v1 import tensor_pb2
from services.coordinator.output_cache import StepOutputCache


@pytest.fixture()
def transport(tmp_path: Path) -> Iterator[TensorTransport]:
    t = TensorTransport(shm_dir=tmp_path, inline_threshold=0)
    t.address = "coordinator:1"  # this process's own leases: released at once, no RPC
    yield t
    t.close()


def state(transport: TensorTransport, nbytes: int) -> tensor_pb2.StageState:
    return transport.export_state({"kv": torch.zeros(nbytes, dtype=torch.uint8)}, {})


def test_lru_keeps_the_byte_bound_and_releases_what_it_evicts(transport: TensorTransport) -> None:
    cache = StepOutputCache(transport, max_bytes=3000, max_age_s=60)
    for key in "abc":
        entry = cache.put(key, "condition-kv", transport.address, state(transport, 1000))
        assert entry is not None
        cache.unpin(entry)
    assert transport.live_leases() == 3 and cache.nbytes == 3000
    assert cache.get("a", "condition-kv") is not None  # "a" is now the most recently used
    cache.unpin(cache._entries["a"])
    cache.put("d", "condition-kv", transport.address, state(transport, 1000))
    assert not cache.peek("b") and all(cache.peek(k) for k in "acd")
    assert transport.live_leases() == 3  # b's lease went back with it
    assert cache.put("huge", "condition-kv", transport.address, state(transport, 5000)) is None


def test_a_pinned_entry_is_released_only_when_its_last_reader_is_done(transport: TensorTransport) -> None:
    cache = StepOutputCache(transport, max_bytes=1000, max_age_s=60)
    first = cache.put("a", "condition-kv", transport.address, state(transport, 1000))
    assert first is not None  # pinned by the request that made it
    second = cache.put("b", "condition-kv", transport.address, state(transport, 1000))  # evicts a
    assert second is not None and not cache.peek("a") and first.evicted
    assert transport.live_leases() == 2  # a is still read: not released
    cache.unpin(first)
    assert transport.live_leases() == 1
    cache.unpin(second)
    cache.invalidate(second)
    assert transport.live_leases() == 0 and len(cache) == 0


def test_entries_age_out_and_an_empty_bound_caches_nothing(transport: TensorTransport) -> None:
    cache = StepOutputCache(transport, max_bytes=1000, max_age_s=0.0)
    entry = cache.put("a", "condition-kv", transport.address, state(transport, 10))
    assert entry is not None
    cache.unpin(entry)
    assert cache.get("a", "condition-kv") is None and transport.live_leases() == 0
    off = StepOutputCache(transport, max_bytes=0, max_age_s=60)
    assert off.put("a", "condition-kv", transport.address, state(transport, 10)) is None
