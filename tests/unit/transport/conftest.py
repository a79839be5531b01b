"""Fixtures for transport tests: real /dev/shm, and a check that nothing is left behind."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omni_common.errors import OmniError
from omni_common.transport import TensorTransport
from omnistage.v1 import tensor_pb2

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


def set_field(field: str, value: Any) -> Callable[[tensor_pb2.TensorRef], None]:
    """An edit of a ref: `field` ("shape", "shm.offset", "cuda_ipc.ipc_handle"...) set to
    `value`, or to value(ref) when it is callable."""

    def edit(r: tensor_pb2.TensorRef) -> None:
        *path, name = field.split(".")
        obj = r
        for part in path:
            obj = getattr(obj, part)
        new = value(r) if callable(value) else value
        if name == "shape":
            del r.shape[:]
            r.shape.extend(new)
        else:
            setattr(obj, name, new)

    return edit


def forged(ref: tensor_pb2.TensorRef, edit: Callable[[tensor_pb2.TensorRef], None]) -> tensor_pb2.TensorRef:
    bad = tensor_pb2.TensorRef()
    bad.CopyFrom(ref)
    edit(bad)
    return bad


def expect(
    consumer: TensorTransport, bad: tensor_pb2.TensorRef, err: type[OmniError], full_lease: str
) -> None:
    """Importing `bad` fails with `err`, and the message shows no path or lease key."""
    with pytest.raises(err) as info:
        consumer.import_tensor_sync(bad)
    msg = info.value.message
    assert "/dev/shm" not in msg and full_lease not in msg and "omnistage-" not in msg
