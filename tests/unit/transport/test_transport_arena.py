"""The arena grows by segments, reuses freed space, coalesces; leases expire and release."""

from __future__ import annotations

import time

import torch

from omni_common.transport.arena import ShmArena

from .conftest import SHM, shm_files


def test_free_list_reuses_and_coalesces(tmp_path) -> None:
    arena = ShmArena(tmp_path, "0" * 16, 4096)
    try:
        a = arena.allocate(1000)  # 1024 after alignment
        b = arena.allocate(1000)
        c = arena.allocate(1000)
        assert [a[1], b[1], c[1]] == [0, 1024, 2048]
        arena.free(*a, 1000)
        assert arena.allocate(10) == (0, 0)  # first fit reuses the hole
        arena.free(0, 0, 10)
        arena.free(*b, 1000)
        seg = arena.segments[0]
        assert list(zip(seg.free_off, seg.free_len, strict=True)) == [(0, 2048), (3072, 1024)]
        arena.free(*c, 1000)
        assert seg.empty()  # all three holes merged into one extent
        assert arena.allocate(4096) == (0, 0)
    finally:
        arena.close()
    assert list(tmp_path.iterdir()) == []


def test_arena_grows_by_segments_and_drops_oversized_ones(tmp_path) -> None:
    arena = ShmArena(tmp_path, "1" * 16, 4096)
    try:
        assert arena.allocate(4096) == (0, 0)
        assert arena.allocate(100) == (1, 0)  # full: a new segment
        big = arena.allocate(10_000)  # larger than a segment: its own segment
        assert big == (2, 0) and arena.segments[2].size == 10_240
        arena.free(*big, 10_000)
        assert 2 not in arena.segments
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            f"omnistage-{'1' * 16}-0",
            f"omnistage-{'1' * 16}-1",
        ]
    finally:
        arena.close()


def test_segments_are_private_files(make_transport) -> None:
    import os
    import stat

    before = shm_files()
    tr = make_transport(inline_threshold=0)
    tr.export("x", torch.ones(10))
    new = shm_files() - before
    assert new == {f"omnistage-{tr.token}-0", f"omnistage-{tr.token}-leases"}
    for name in new:
        assert stat.S_IMODE(os.stat(f"{SHM}/{name}").st_mode) == 0o600
    tr.close()
    assert shm_files() - before == set()
    tr.close()  # idempotent


def test_release_is_idempotent_and_frees_memory(make_transport) -> None:
    tr = make_transport(inline_threshold=0)
    refs = [tr.export(f"t{i}", torch.ones(1000)) for i in range(3)]
    ids = [r.shm.lease_id for r in refs]
    assert tr.live_leases() == 3
    assert tr.release(ids[:2]) == 2
    assert tr.release(ids) == 1
    assert tr.release([*ids, "garbage", "f" * 16 + "-0-" + "0" * 16]) == 0
    assert tr.live_leases() == 0
    assert tr.export("again", torch.ones(1000)).shm.offset == 0


def test_the_results_sent_for_a_request_are_released_by_its_id(make_transport) -> None:
    """A caller that abandoned a call cannot name a result that was on its way: the request id
    ends it (and only the results sent for that request)."""
    tr = make_transport(inline_threshold=0)
    ids = [tr.export(f"t{i}", torch.ones(1000)).shm.lease_id for i in range(3)]
    tr.sent("request-a", ids[:2])
    tr.sent("request-b", ids[2:])
    assert tr.release_request("unknown") == 0
    assert tr.release_request("request-a") == 2
    assert tr.live_leases() == 1
    assert tr.release_request("request-a") == 0  # once
    assert tr.release(ids[2:]) == 1 and tr.release_request("request-b") == 0  # read and released


def test_expired_leases_are_reaped(make_transport) -> None:
    tr = make_transport(inline_threshold=0, lease_ttl_s=0.1)
    ref = tr.export("x", torch.ones(1000))
    deadline = time.time() + 3
    while tr.live_leases() and time.time() < deadline:
        time.sleep(0.02)
    assert tr.live_leases() == 0
    assert tr.release([ref.shm.lease_id]) == 0
    assert tr.export("y", torch.ones(1000)).shm.offset == 0  # memory came back
