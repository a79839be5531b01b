"""Content-addressed outputs of plan steps, reused across requests (e.g. GLM-Image's condition
KV cache, a function of the condition image alone).

A plan step with a `cache_key` (its family computes it from what the outputs depend on, such
as input image digests) is looked up here before it runs: a hit skips the step and the steps
only it needed. An entry is the step's output handles; the cache owns their leases (the
producer keeps the memory) and releases them when it evicts the entry: least recently used
first once the entries' bytes pass the bound, and at the latest after `max_age_s`, before the
producer's lease TTL would end them. A request that uses an entry pins it until the request
ends, so an eviction never frees memory a stage is still reading.

An entry whose producer dies, or whose leases a consumer cannot find, is invalidated by the
flow, which recomputes the step (services/coordinator/flow.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from omni_common.transport import TensorTransport
from omnistage.v1 import tensor_pb2
from services.coordinator.leases import release_later

log = logging.getLogger("omnistage.coordinator")


@dataclass(eq=False)
class CachedOutput:
    key: str
    step: str
    producer: str  # address of the replica that holds the memory
    state: tensor_pb2.StageState
    nbytes: int
    created: float  # time.monotonic()
    pins: int = 0
    evicted: bool = False


class StepOutputCache:
    def __init__(
        self,
        transport: TensorTransport,
        max_bytes: int,
        max_age_s: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.transport = transport
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._entries: OrderedDict[str, CachedOutput] = OrderedDict()
        self.nbytes = 0
        registry = registry or CollectorRegistry()
        self._hits = Counter(
            "omnistage_coordinator_step_cache_hits",
            "Plan steps skipped because a request with the same content key ran them",
            ["step"],
            registry=registry,
        )
        self._misses = Counter(
            "omnistage_coordinator_step_cache_misses",
            "Cacheable plan steps that had to run",
            ["step"],
            registry=registry,
        )
        self._evictions = Counter(
            "omnistage_coordinator_step_cache_evictions",
            "Cached step outputs dropped (byte bound, age, or invalidated)",
            registry=registry,
        )
        Gauge(
            "omnistage_coordinator_step_cache_bytes",
            "Bytes of cached step outputs (held in their producers' memory)",
            registry=registry,
        ).set_function(lambda: self.nbytes)
        Gauge(
            "omnistage_coordinator_step_cache_entries",
            "Cached step outputs",
            registry=registry,
        ).set_function(lambda: len(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: str) -> bool:
        """Whether `key` has a fresh entry (no statistics, no pin)."""
        entry = self._entries.get(key)
        return entry is not None and time.monotonic() - entry.created <= self.max_age_s

    def get(self, key: str, step: str) -> CachedOutput | None:
        """The entry of `key`, pinned (unpin it when done), or None (a miss is counted)."""
        entry = self._entries.get(key)
        if entry is not None and time.monotonic() - entry.created > self.max_age_s:
            self._evict(entry)
            entry = None
        if entry is None:
            self._misses.labels(step=step).inc()
            return None
        self._entries.move_to_end(key)
        self._hits.labels(step=step).inc()
        entry.pins += 1
        return entry

    def put(self, key: str, step: str, producer: str, state: tensor_pb2.StageState) -> CachedOutput | None:
        """Cache a step's output, pinned for the request that made it; None when it does not fit
        (the caller keeps its leases then). The cache owns the leases of what it takes."""
        nbytes = sum(ref.nbytes for ref in state.tensors)
        if self.max_bytes <= 0 or nbytes > self.max_bytes:
            return None
        old = self._entries.get(key)
        if old is not None:
            self._evict(old)
        entry = CachedOutput(key, step, producer, state, nbytes, time.monotonic(), pins=1)
        self._entries[key] = entry
        self.nbytes += nbytes
        for victim in list(self._entries.values()):
            if self.nbytes <= self.max_bytes:
                break
            if victim is not entry:
                self._evict(victim)
        return entry

    def unpin(self, entry: CachedOutput) -> None:
        entry.pins -= 1
        if entry.evicted and entry.pins == 0:
            self._release(entry)

    def invalidate(self, entry: CachedOutput) -> None:
        """Drop an entry that turned out unusable (its producer died, a lease was gone)."""
        if not entry.evicted:
            self._evict(entry)

    def _evict(self, entry: CachedOutput) -> None:
        self._entries.pop(entry.key, None)
        self.nbytes -= entry.nbytes
        entry.evicted = True
        self._evictions.inc()
        if entry.pins == 0:
            self._release(entry)

    def _release(self, entry: CachedOutput) -> None:
        release_later(self.transport, entry.producer, self.transport.lease_ids(entry.state))

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self._evict(entry)
