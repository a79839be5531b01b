"""What a stage call's error means to the coordinator: the replica lost (the call moves to
another replica) or the request's own error (the client sees it)."""

from __future__ import annotations

import logging

import grpc

from omni_common.errors import OmniError, Unavailable, error_from_rpc
from services.coordinator.registry import Replica, ReplicaPool

log = logging.getLogger("omnistage.coordinator")

# What a replica may answer about the request itself: the caller's to fix, or to retry later
# (the whole cluster would answer the same). Any other failure is the replica's own (a bug,
# a misconfiguration, or a fake that registered with the token and answers
# FAILED_PRECONDITION to everything): the replica is treated as lost and the call moves to
# another, so one bad replica cannot fail requests that a healthy one would serve.
CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


class ReplicaLost(Unavailable):
    """The replica went away mid-call (killed, crashed, draining), or failed it on its own.
    `own_error`: what it answered, when the request's own content may be the cause (INTERNAL,
    UNKNOWN): with no other replica to try, the caller gets that, not a wait for one."""

    def __init__(self, message: str, own_error: OmniError | None = None) -> None:
        super().__init__(message)
        self.own_error = own_error


def stage_failure(err: grpc.RpcError, replica: Replica, pool: ReplicaPool, request_id: str) -> OmniError:
    """What a stage call's error means: the replica lost (ReplicaLost: the call moves to
    another; it leaves routing too unless the request itself may be the cause), or the
    request's own error, which the client sees."""
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) and _connection_lost(err):
        pool.mark_failed(replica)
        return ReplicaLost(f"{replica.stage} replica {replica.address} was lost")
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        pool.mark_failed(replica)
        return ReplicaLost(f"{replica.stage} replica {replica.address} is unavailable")
    if err.code() == grpc.StatusCode.CANCELLED:
        # Not our cancel (that arrives as asyncio's): the replica's server stopped with
        # the call in flight, a drain racing its deregistration.
        pool.mark_failed(replica)
        return ReplicaLost(f"{replica.stage} replica {replica.address} stopped mid-call")
    if err.code() not in CLIENT_ERRORS:
        # INTERNAL or UNKNOWN may come from this request's content (it would fail the
        # same way everywhere): the call moves on, but the replica stays routable.
        own = err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        if not own:
            pool.mark_failed(replica)
        log.warning(
            "request %s: %s replica %s answered %s: %s",
            request_id,
            replica.stage,
            replica.address,
            err.code().name,
            (err.details() or "")[:200],
        )
        message = f"{replica.stage} replica {replica.address} failed the call"
        return ReplicaLost(message, error_from_rpc(err) if own else None)
    return error_from_rpc(err)


def _connection_lost(err: grpc.RpcError) -> bool:
    """A call that broke because the peer went away (not a status the peer chose)."""
    details = (err.details() or "").lower()
    return any(
        word in details for word in ("socket closed", "connection reset", "rst_stream", "goaway", "connect")
    )
