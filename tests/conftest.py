"""Fixtures shared by every test layer: the tiny model and the shared-memory leak check."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHM_DIR = Path("/dev/shm")


def omnistage_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("omnistage-*")}


def assert_no_segment_added(before: set[str]) -> None:
    """No segment is left that was not there `before`. Those that were may be gone: the processes
    a test starts sweep what dead processes left (an earlier, killed run's), as they should."""
    added = omnistage_segments() - before
    assert not added, f"shared-memory segments left behind: {sorted(added)}"


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

    left = omnistage_segments() - before
    # Segments of this very process are closed at exit (atexit); count only what other,
    # dead processes left: those are leaks.
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
