"""Forged or stale handles are refused with the right status, and errors leak no secrets."""

from __future__ import annotations

import time

import pytest
import torch

from omni_common.errors import (
    Aborted,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from omni_common.transport import TensorTransport
from omnistage.v1 import tensor_pb2

from .conftest import expect, forged
from .conftest import set_field as _set


@pytest.fixture
def setup(make_transport) -> tuple[TensorTransport, TensorTransport, tensor_pb2.TensorRef]:
    producer = make_transport(inline_threshold=0)
    consumer = make_transport(inline_threshold=0)
    ref = producer.export("x", torch.arange(1024, dtype=torch.float32))
    return producer, consumer, ref


CASES = [
    ("path traversal arena id", _set("shm.arena_id", "../../etc/passwd"), InvalidArgument),
    ("arena id with slash", _set("shm.arena_id", lambda r: r.shm.arena_id + "/x"), InvalidArgument),
    ("arena of another token", _set("shm.arena_id", "0123456789abcdef-0"), PermissionDenied),
    ("other segment index", _set("shm.arena_id", lambda r: r.shm.arena_id[:-1] + "7"), PermissionDenied),
    ("forged offset", _set("shm.offset", lambda r: r.shm.offset + 256), PermissionDenied),
    ("offset overflow", _set("shm.offset", 2**64 - 1), PermissionDenied),
    ("forged generation", _set("shm.generation", lambda r: r.shm.generation + 1), PermissionDenied),
    ("malformed lease", _set("shm.lease_id", "not-a-lease"), InvalidArgument),
    ("forged nonce", _set("shm.lease_id", lambda r: r.shm.lease_id[:-4] + "0000"), NotFound),
    ("forged slot", _set("shm.lease_id", lambda r: r.shm.lease_id.replace("-0-", "-9-")), NotFound),
    ("slot beyond table", _set("shm.lease_id", lambda r: r.shm.lease_id.replace("-0-", "-99999-")), NotFound),
    (
        "unknown token",
        lambda r: (
            setattr(r.shm, "arena_id", "0123456789abcdef-0"),
            setattr(r.shm, "lease_id", "0123456789abcdef-0-" + "1" * 16),
        ),
        NotFound,
    ),
    ("shm nbytes differs", _set("shm.nbytes", 8192), InvalidArgument),
    ("shape and nbytes differ", _set("shape", [2048]), InvalidArgument),
    ("negative dim", _set("shape", [-1, -1024]), InvalidArgument),
    ("unknown dtype", _set("dtype", "float33"), InvalidArgument),
    (
        "huge nbytes",
        lambda r: (
            _set("shape", [1 << 40])(r),
            setattr(r, "nbytes", 4 << 40),
            setattr(r.shm, "nbytes", 4 << 40),
        ),
        ResourceExhausted,
    ),
]


@pytest.mark.parametrize(("case", "edit", "err"), CASES, ids=[c[0] for c in CASES])
def test_forged_handles_are_refused(setup, case, edit, err) -> None:
    _, consumer, ref = setup
    expect(consumer, forged(ref, edit), err, ref.shm.lease_id)


def test_valid_handle_imports_in_another_transport(setup) -> None:
    _, consumer, ref = setup
    assert torch.equal(consumer.import_tensor_sync(ref), torch.arange(1024, dtype=torch.float32))


def test_released_lease_is_not_found(setup) -> None:
    producer, consumer, ref = setup
    producer.release([ref.shm.lease_id])
    expect(consumer, ref, NotFound, ref.shm.lease_id)


def test_expired_lease_is_not_found(make_transport) -> None:
    producer = make_transport(inline_threshold=0, lease_ttl_s=0.05)
    consumer = make_transport()
    ref = producer.export("x", torch.ones(100))
    time.sleep(0.1)
    expect(consumer, ref, NotFound, ref.shm.lease_id)


def test_closed_producer_is_unknown_arena(setup) -> None:
    producer, consumer, ref = setup
    producer.close()
    expect(consumer, ref, NotFound, ref.shm.lease_id)


def test_region_reused_by_a_new_lease_is_refused(setup) -> None:
    producer, consumer, ref = setup
    producer.release([ref.shm.lease_id])
    fresh = producer.export("y", torch.zeros(1024))
    assert fresh.shm.offset == ref.shm.offset
    stale = forged(ref, _set("shm.lease_id", fresh.shm.lease_id))
    expect(consumer, stale, PermissionDenied, fresh.shm.lease_id)  # generation differs


def test_release_during_copy_is_aborted(setup, monkeypatch) -> None:
    producer, consumer, ref = setup
    import omni_common.transport.peers as peers

    real = peers.np.copyto

    def copy_then_release(dst, src):
        real(dst, src)
        producer.release([ref.shm.lease_id])

    monkeypatch.setattr(peers.np, "copyto", copy_then_release)
    expect(consumer, ref, Aborted, ref.shm.lease_id)


def test_lease_table_full_is_resource_exhausted(make_transport, monkeypatch) -> None:
    tr = make_transport(inline_threshold=0)
    tr.export("first", torch.ones(10))
    assert tr._table is not None
    monkeypatch.setattr(tr._table, "_free", [])
    with pytest.raises(ResourceExhausted):
        tr.export("x", torch.ones(10))
    assert tr.live_leases() == 1


def test_tensor_over_limit_is_refused_at_export(make_transport) -> None:
    tr = make_transport(inline_threshold=0, max_tensor_bytes=100)
    with pytest.raises(ResourceExhausted):
        tr.export("x", torch.ones(100))
