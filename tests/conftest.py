"""Fixtures shared by every test layer: the tiny model and the shared-memory leak check."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHM_DIR = Path("/dev/shm")


def omnistage_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("omnistage-*")}


def segment_owner(name: str) -> int | None:
    """The pid that made segment `name`: an arena file's by its lease table's header, a queue's
    by its stamp; None when neither can be read (the table already unlinked)."""
    from omni_common.transport.lease_table import HEADER, QUEUE_RE
    from omni_common.transport.owner import STAMP

    if QUEUE_RE.fullmatch(name):
        path, layout, field = SHM_DIR / name, STAMP, 1
    else:
        token = name.split("-")[1]
        path, layout, field = SHM_DIR / f"omnistage-{token}-leases", HEADER, 3
    try:
        with open(path, "rb") as file:
            head = file.read(layout.size)
    except OSError:
        return None
    return int(layout.unpack(head)[field]) if len(head) == layout.size else None


def ours(names: set[str], owners: Collection[int] = ()) -> set[str]:
    """The segments this test session's processes made: this process's, and those of every
    process a LocalCluster started. Another omnistage on the host (another engineer's cluster,
    a CI job beside this one) is none of this suite's business. A segment whose owner cannot
    be read counts as ours: a check that cannot tell fails rather than passes. `owners` adds
    pids a test started some other way (e.g. the services of an `omnistage cluster up`)."""
    from omni_common.cluster import LocalCluster

    mine = {os.getpid(), *LocalCluster.started, *owners}
    return {name for name in names if segment_owner(name) in (mine | {None})}


def assert_no_segment_added(before: set[str], owners: Collection[int] = ()) -> None:
    """No segment that this session's processes made is left that was not there `before`. Those
    that were may be gone: the processes a test starts sweep what dead processes left (an
    earlier, killed run's), as they should."""
    added = ours(omnistage_segments() - before, owners)
    assert not added, f"shared-memory segments left behind: {sorted(added)}"


def running(pid: int) -> bool:
    """Whether `pid` is a process that still runs (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen-Image fixture (diffusers layout), built once per session."""
    from omni_common.models.qwenimage.fixture import build_tiny_fixture

    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "qwen-image-tiny")


@pytest.fixture(scope="session")
def glm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random GLM-Image fixture (diffusers layout), built once per session."""
    from omni_common.models.glm_image.fixture import build_tiny_fixture

    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "glm-image-tiny")


@pytest.fixture(scope="session")
def omni_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2.5-Omni fixture (transformers layout), built once per session."""
    from omni_common.models.qwen_omni.fixture import build_tiny_fixture

    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "qwen-omni-tiny")


@pytest.fixture(scope="session", autouse=True)
def no_segment_left_behind() -> Iterator[None]:
    """After the whole suite, no omnistage shared-memory segment may remain."""
    before = omnistage_segments()
    yield
    import gc

    gc.collect()
    from omni_common.transport import sweep_stale_segments

    left = ours(omnistage_segments() - before)
    # Segments of this very process are closed at exit (atexit); count only what other,
    # dead processes of this session left: those are leaks.
    sweep_stale_segments()
    leaked = left - omnistage_segments() if left else set()
    assert not leaked, f"dead processes left shared-memory segments: {sorted(leaked)}"


def pytest_configure(config: pytest.Config) -> None:
    """`scripts/test.sh vllm` sets OMNISTAGE_VLLM_REQUIRED: there a vLLM that does not import is a
    failure, not a reason to skip the backend's tests."""
    if os.environ.get("OMNISTAGE_VLLM_REQUIRED") == "1":
        from omni_common.models.qwenimage.vllm_encoder import vllm_available

        if not vllm_available():
            raise pytest.UsageError("OMNISTAGE_VLLM_REQUIRED=1 but vLLM does not import in this environment")
