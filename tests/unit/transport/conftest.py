"""Fixtures for transport tests: real /dev/shm, and a check that nothing is left behind."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from omni_common.transport import TensorTransport

SHM = "/dev/shm"


def shm_files() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("omnistage-")}


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    before = shm_files()
    yield
    assert shm_files() - before == set()


@pytest.fixture
def make_transport() -> Iterator[Callable[..., TensorTransport]]:
    made: list[TensorTransport] = []

    def make(**kw: object) -> TensorTransport:
        kw.setdefault("shm_dir", SHM)
        kw.setdefault("segment_bytes", 1 << 20)
        t = TensorTransport(**kw)  # type: ignore[arg-type]
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
