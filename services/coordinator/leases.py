"""Leases a request holds, per producer address, and their release.

Releases run in the background: they free memory but nothing waits on them, so they stay off
the request's critical path. A producer that is gone cannot release; its segments are swept
here (same host) once its leases are no longer needed.
"""

from __future__ import annotations

import asyncio
import logging

from omni_common.transport import TensorTransport, release_remote, sweep_stale_segments
from omnistage.v1 import tensor_pb2

log = logging.getLogger("omnistage.coordinator")


class Leases:
    def __init__(self, transport: TensorTransport) -> None:
        self.transport = transport
        self.held: dict[str, list[str]] = {}

    def add(self, producer: str, state: tensor_pb2.StageState) -> None:
        self.held.setdefault(producer, []).extend(self.transport.lease_ids(state))

    def take(self, producer: str, state: tensor_pb2.StageState) -> None:
        """Stop holding the leases of `state` without releasing them (someone else owns them now)."""
        ids = set(self.transport.lease_ids(state))
        self.held[producer] = [i for i in self.held.get(producer, []) if i not in ids]

    def drop(self, producer: str, state: tensor_pb2.StageState) -> None:
        """Release the leases of one state (e.g. a superseded checkpoint, a consumed output)."""
        self.take(producer, state)
        release_later(self.transport, producer, sorted(set(self.transport.lease_ids(state))))

    def release_all(self) -> None:
        for producer in list(self.held):
            release_later(self.transport, producer, self.held.pop(producer, []))


_pending: set[asyncio.Task[None]] = set()


def release_later(
    transport: TensorTransport, producer: str, lease_ids: list[str], request_id: str = ""
) -> None:
    """Release `lease_ids` at `producer` in the background (this process's own: at once), and
    with `request_id` whatever results it sent for that request (an abandoned call's)."""
    if not lease_ids and not request_id:
        return
    if producer == transport.address:
        transport.release(lease_ids)
        return
    task = asyncio.get_running_loop().create_task(_release(transport, producer, lease_ids, request_id))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


async def _release(transport: TensorTransport, producer: str, lease_ids: list[str], request_id: str) -> None:
    try:
        await release_remote(producer, lease_ids, request_id)
    except Exception as err:
        log.warning("could not release %d leases at %s (%s)", len(lease_ids), producer, err)
        # A dead producer on this host leaves its segments behind: sweep them.
        sweep_stale_segments(transport.shm_dir)
