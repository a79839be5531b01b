"""Conversation affinity: a chat turn goes to the replica that keeps its earlier turns' KV.

A thinker replica keeps the prefix KV of the prompts it served (omni_common/models/
prefix_cache.py), and a conversation's next turn re-sends every earlier turn: on the replica
that served the last turn it pays only for what it adds; on another it computes the whole
history again. This map remembers, per conversation key (omni_common/models/conversation_keys.py,
which says why the key matches the replica's token-level key closely enough), the replica that
served it, bounded and least recently used first out. A plan step with `prefixes` asks it for
the replica of the longest earlier conversation its prompt continues; the pool takes that one
when it is healthy and not much busier than the best (registry.ReplicaPool.pick). A remembered
replica that is gone, drained or no longer serves the role is forgotten when met, and one lost
mid-call at once.

When the preferred replica is much busier, the turn runs elsewhere and its prefix KV moves
there by handle when that is cheaper than recomputing it (prefix_move.py); when it is gone, the
other replica recomputes the prefix.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Container

from prometheus_client import CollectorRegistry, Counter

from omni_common.models.base import PrefixKeys

log = logging.getLogger("omnistage.coordinator")


class PrefixRoutes:
    """Conversation key -> the replica that served it, at most `max_entries` (0 turns it off)."""

    def __init__(self, max_entries: int, registry: CollectorRegistry | None = None) -> None:
        self.max_entries = max_entries
        self._routes: OrderedDict[str, str] = OrderedDict()
        self._calls = Counter(
            "omnistage_coordinator_prefix_affinity",
            "Chat calls that continue an earlier conversation, by where they went: 'hit' (to the "
            "replica that served it), 'busy' (it was much busier), 'unknown' (none remembered, or "
            "it is gone)",
            ["outcome"],
            registry=registry or CollectorRegistry(),
        )

    def __len__(self) -> int:
        return len(self._routes)

    def preferred(self, model: str, keys: PrefixKeys | None, usable: Container[str]) -> str:
        """The address of the replica that served the longest of `keys.reuses` if it is among
        `usable` (healthy, serving the call's role) ("" otherwise); entries whose replica is not
        usable are forgotten."""
        if keys is None or self.max_entries <= 0:
            return ""
        for key in keys.reuses:
            address = self._routes.get(f"{model}|{key}")
            if address is None:
                continue
            if address not in usable:
                del self._routes[f"{model}|{key}"]
                continue
            self._routes.move_to_end(f"{model}|{key}")
            return address
        return ""

    def holder(self, model: str, keys: PrefixKeys | None) -> str:
        """The replica remembered for the longest of `keys.reuses`, usable or not ("" if none)."""
        if keys is None or self.max_entries <= 0:
            return ""
        return next((a for key in keys.reuses if (a := self._routes.get(f"{model}|{key}"))), "")

    def count(self, keys: PrefixKeys | None, preferred: str, chosen: str) -> None:
        """Count where a call that continues a conversation went."""
        if keys is None or not keys.reuses or self.max_entries <= 0:
            return
        outcome = "hit" if preferred and chosen == preferred else "busy" if preferred else "unknown"
        self._calls.labels(outcome=outcome).inc()
        if outcome == "busy":
            busy = "a conversation's turn goes to %s: %s, which keeps its prefix, is busy"
            log.info(busy, chosen, preferred)

    def remember(self, model: str, keys: PrefixKeys | None, address: str) -> None:
        """`address` served the conversation `keys.leaves` (it keeps its prefix now)."""
        if keys is None or self.max_entries <= 0:
            return
        route = f"{model}|{keys.leaves}"
        self._routes[route] = address
        self._routes.move_to_end(route)
        while len(self._routes) > self.max_entries:
            self._routes.popitem(last=False)

    def forget(self, address: str) -> None:
        """The replica at `address` was lost: its prefixes went with it."""
        for route in [r for r, a in self._routes.items() if a == address]:
            del self._routes[route]
