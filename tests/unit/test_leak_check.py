"""The suite's shared-memory leak check counts only what this session's processes made."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_common.transport.lease_table import QUEUE_MAGIC
from omni_common.transport.owner import STAMP
from tests.conftest import SHM_DIR, assert_no_segment_added, omnistage_segments, ours, segment_owner


@pytest.fixture
def made() -> Iterator[list[Path]]:
    """Files this test puts in /dev/shm, removed afterwards whatever happens."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def queue_segment(made: list[Path], owner_pid: int) -> str:
    """A queue segment stamped as made by `owner_pid` (the stamp is all the check reads)."""
    name = f"omnistage-{secrets.token_hex(8)}-queue"
    path = SHM_DIR / name
    path.write_bytes(STAMP.pack(QUEUE_MAGIC, owner_pid, 0, 0))
    made.append(path)
    return name


def test_a_segment_of_another_process_on_the_host_is_not_ours(made: list[Path]) -> None:
    before = omnistage_segments()
    foreign = queue_segment(made, owner_pid=1)  # not this process, nor one a LocalCluster started
    assert segment_owner(foreign) == 1
    assert ours({foreign}) == set()
    assert_no_segment_added(before)  # another omnistage on the host does not fail the check


def test_a_segment_of_this_session_is_ours_and_fails_the_check(made: list[Path]) -> None:
    before = omnistage_segments()
    mine = queue_segment(made, owner_pid=os.getpid())
    started_otherwise = queue_segment(made, owner_pid=1)
    assert ours({mine}) == {mine}
    assert ours({started_otherwise}, owners={1}) == {started_otherwise}
    with pytest.raises(AssertionError, match=mine):
        assert_no_segment_added(before)


def test_a_segment_whose_owner_cannot_be_read_counts_as_ours(made: list[Path]) -> None:
    orphan = f"omnistage-{secrets.token_hex(8)}-0"  # an arena file without its lease table
    (SHM_DIR / orphan).write_bytes(b"\0" * 64)
    made.append(SHM_DIR / orphan)
    assert segment_owner(orphan) is None and ours({orphan}) == {orphan}


def test_a_segment_of_a_process_a_local_cluster_started_is_ours(
    made: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_common.cluster import LocalCluster

    monkeypatch.setattr(LocalCluster, "started", {4_000_000})  # a replica's pid, long dead
    replicas = queue_segment(made, owner_pid=4_000_000)
    assert ours({replicas}) == {replicas}
