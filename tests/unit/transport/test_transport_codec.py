"""Every dtype and shape round-trips bit for bit, inline and through shm."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_common.errors import InvalidArgument
from omni_common.transport import DTYPES, TensorTransport
from omnistage.v1 import tensor_pb2


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def roundtrip(tr: TensorTransport, t: torch.Tensor) -> tuple[tensor_pb2.TensorRef, torch.Tensor]:
    ref = tr.export("x", t)
    wire = tensor_pb2.TensorRef.FromString(ref.SerializeToString())
    out = tr.import_tensor_sync(wire)
    tr.release(tr.lease_ids(tensor_pb2.StageState(tensors=[ref])))
    return ref, out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("threshold", [1 << 16, 0], ids=["inline", "shm"])
def test_every_dtype_round_trips(make_transport, name: str, threshold: int) -> None:
    tr = make_transport(inline_threshold=threshold)
    t = random_tensor(DTYPES[name], (3, 5))
    ref, out = roundtrip(tr, t)
    assert ref.dtype == name
    assert ref.WhichOneof("location") == ("inline_data" if threshold else "shm")
    assert same_bytes(t, out)
    assert tr.live_leases() == 0


@pytest.mark.parametrize("threshold", [1 << 16, 0], ids=["inline", "shm"])
def test_zero_dim_empty_and_non_contiguous(make_transport, threshold: int) -> None:
    tr = make_transport(inline_threshold=threshold)
    cases = [
        torch.tensor(3.5),
        torch.empty((0, 4), dtype=torch.float16),
        torch.arange(24, dtype=torch.int32).reshape(4, 6).t(),
        torch.arange(40.0).reshape(5, 8)[:, ::3],
    ]
    for t in cases:
        _, out = roundtrip(tr, t)
        assert out.shape == t.shape and torch.equal(out, t)
        assert out.is_contiguous()


def test_bfloat16_keeps_its_two_bytes(make_transport) -> None:
    tr = make_transport(inline_threshold=0)
    t = torch.randn(64, dtype=torch.float32).to(torch.bfloat16)
    ref, out = roundtrip(tr, t)
    assert ref.nbytes == 128
    assert same_bytes(t, out)


def test_import_copies_so_release_does_not_change_the_result(make_transport) -> None:
    tr = make_transport(inline_threshold=0)
    t = torch.arange(1000, dtype=torch.int64)
    ref = tr.export("x", t)
    out = tr.import_tensor_sync(ref)
    tr.release([ref.shm.lease_id])
    tr.export("y", torch.zeros(1000, dtype=torch.int64))  # reuses the region
    assert torch.equal(out, t)


def test_import_state_returns_tensors_and_meta(make_transport) -> None:
    tr = make_transport(inline_threshold=1024)
    tensors = {"small": torch.ones(3), "big": torch.arange(10_000, dtype=torch.float64)}
    state = tr.export_state(tensors, {"height": "512"})
    assert len(tr.lease_ids(state)) == 1
    got, meta = asyncio.run(tr.import_state(state))
    assert meta == {"height": "512"}
    assert set(got) == {"small", "big"} and torch.equal(got["big"], tensors["big"])
    assert tr.release(tr.lease_ids(state)) == 1


def test_duplicate_names_are_refused(make_transport) -> None:
    tr = make_transport()
    ref = tr.export("a", torch.ones(2))
    with pytest.raises(InvalidArgument):
        asyncio.run(tr.import_state(tensor_pb2.StageState(tensors=[ref, ref])))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_dtypes_are_refused(make_transport) -> None:
    tr = make_transport()
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(InvalidArgument):
        tr.export("q", q)
