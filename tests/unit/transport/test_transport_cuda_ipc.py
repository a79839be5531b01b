"""CUDA IPC leases without a GPU: PyTorch's sharing is replaced by a stand-in that keeps a
CPU buffer, so the lease, the ref, the checks a consumer makes before CUDA sees anything,
release, expiry and the fetch fallback all run here. tests/gpu/ runs the real thing."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable

import grpc
import pytest
import torch

from omni_common.errors import InvalidArgument, NotFound, OmniError, PermissionDenied, ResourceExhausted
from omni_common.net.rpc import aio_server
from omni_common.transport import Consumer, TensorTransport, add_tensor_store, cuda_ipc, route
from omni_common.transport import transport as transport_module
from omni_common.transport.lease_table import SLOT, SLOT_BYTES
from omnistage.v1 import tensor_pb2

from .conftest import expect, forged, set_field

GPU = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
ON_GPU = Consumer("", 0, GPU)


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omnistage.transport"]


def fake_share(tensor: torch.Tensor) -> cuda_ipc.Shared:
    """What cuda_ipc.share returns, with a CPU clone standing in for the GPU memory."""
    handle = b"\x02c" + os.urandom(64)
    return cuda_ipc.Shared(tensor.detach().clone(), GPU, handle, 1536, os.urandom(64))


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[cuda_ipc.Shared]:
    """Exports take the CUDA IPC path; the consumer side believes it has no CUDA."""
    shared: list[cuda_ipc.Shared] = []

    def share(tensor: torch.Tensor) -> cuda_ipc.Shared:
        shared.append(fake_share(tensor))
        return shared[-1]

    monkeypatch.setattr(
        transport_module, "use_cuda_ipc", lambda consumer, host, device: bool(consumer.gpu_uuid)
    )
    monkeypatch.setattr(cuda_ipc, "share", share)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(route, "_said", set())
    return shared


@pytest.fixture
def setup(make_transport, fake_gpu) -> tuple[TensorTransport, TensorTransport, tensor_pb2.TensorRef]:
    producer = make_transport(inline_threshold=0, address="127.0.0.1:1")
    consumer = make_transport()
    return producer, consumer, producer.export("x", torch.arange(1024, dtype=torch.float32), consumer=ON_GPU)


def test_slot_keeps_its_64_bytes() -> None:
    assert SLOT.size == SLOT_BYTES


def test_device_tensor_for_a_consumer_on_its_gpu_is_a_cuda_ipc_lease(setup, fake_gpu) -> None:
    producer, _, ref = setup
    ipc, shared = ref.cuda_ipc, fake_gpu[0]
    assert ref.WhichOneof("location") == "cuda_ipc"
    assert (ref.dtype, list(ref.shape), ref.nbytes) == ("float32", [1024], 4096)
    assert (ipc.gpu_uuid, ipc.ipc_handle, ipc.offset, ipc.nbytes) == (GPU, shared.handle, 1536, 4096)
    assert (ipc.event_handle, ipc.producer_address) == (shared.event, "127.0.0.1:1")
    assert TensorTransport.lease_ids(tensor_pb2.StageState(tensors=[ref])) == [ipc.lease_id]
    assert producer.live_leases() == 1
    assert tensor_pb2.TensorRef.FromString(ref.SerializeToString()) == ref


def test_cpu_consumer_gets_a_clear_unimplemented(setup) -> None:
    _, consumer, ref = setup
    with pytest.raises(cuda_ipc.CannotOpenHere) as info:
        consumer.import_tensor_sync(ref)
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "has no CUDA" in info.value.message and ref.cuda_ipc.lease_id not in info.value.message


def test_consumer_that_does_not_see_the_gpu_gets_failed_precondition(setup, monkeypatch) -> None:
    _, consumer, ref = setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ipc, "local_cuda_index", lambda uuid: None)
    with pytest.raises(cuda_ipc.CannotOpenHere) as info:
        consumer.import_tensor_sync(ref)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def _edit(field: str, value: object) -> Callable[[tensor_pb2.TensorRef], None]:
    return set_field(field.replace("ipc.", "cuda_ipc.", 1), value)


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


CASES = [
    ("malformed lease", _edit("ipc.lease_id", "../../x"), InvalidArgument),
    ("forged nonce", _edit("ipc.lease_id", lambda r: r.cuda_ipc.lease_id[:-4] + "0000"), NotFound),
    ("forged slot", _edit("ipc.lease_id", lambda r: r.cuda_ipc.lease_id.replace("-0-", "-9-")), NotFound),
    ("unknown producer", _edit("ipc.lease_id", "0123456789abcdef-0-" + "1" * 16), NotFound),
    ("forged handle", _edit("ipc.ipc_handle", lambda r: _flip(r.cuda_ipc.ipc_handle)), PermissionDenied),
    ("forged event", _edit("ipc.event_handle", lambda r: _flip(r.cuda_ipc.event_handle)), PermissionDenied),
    ("event dropped", _edit("ipc.event_handle", b""), PermissionDenied),
    ("short event", _edit("ipc.event_handle", b"\x01" * 8), InvalidArgument),
    ("huge handle", _edit("ipc.ipc_handle", b"\x02c" * 1000), InvalidArgument),
    ("other gpu", _edit("ipc.gpu_uuid", "GPU-bbbbbbbb"), PermissionDenied),
    ("forged offset", _edit("ipc.offset", lambda r: r.cuda_ipc.offset + 256), PermissionDenied),
    ("ipc nbytes differs", _edit("ipc.nbytes", 8192), InvalidArgument),
    (
        "larger region, consistent header",
        lambda r: (
            _edit("shape", [2048])(r),
            setattr(r, "nbytes", 8192),
            setattr(r.cuda_ipc, "nbytes", 8192),
        ),
        PermissionDenied,
    ),
    ("unknown dtype", _edit("dtype", "float33"), InvalidArgument),
]


@pytest.mark.parametrize(("case", "edit", "err"), CASES, ids=[c[0] for c in CASES])
def test_forged_cuda_ipc_refs_are_refused_before_cuda(setup, case, edit, err) -> None:
    """Each forgery fails its check; a ref that passed every check would reach the (absent)
    CUDA and be UNIMPLEMENTED instead."""
    _, consumer, ref = setup
    expect(consumer, forged(ref, edit), err, ref.cuda_ipc.lease_id)


def test_shm_lease_cannot_pass_as_gpu_memory_nor_the_reverse(setup, make_transport) -> None:
    producer, consumer, ref = setup
    shm_ref = producer.export("y", torch.zeros(1024))  # the same host, no GPU named: shm
    assert shm_ref.WhichOneof("location") == "shm"
    as_ipc = tensor_pb2.TensorRef()
    as_ipc.CopyFrom(ref)
    as_ipc.cuda_ipc.lease_id = shm_ref.shm.lease_id
    as_ipc.cuda_ipc.offset = shm_ref.shm.offset
    with pytest.raises(PermissionDenied):
        consumer.import_tensor_sync(as_ipc)
    as_shm = tensor_pb2.TensorRef()
    as_shm.CopyFrom(shm_ref)
    as_shm.shm.lease_id = ref.cuda_ipc.lease_id
    with pytest.raises(PermissionDenied):
        consumer.import_tensor_sync(as_shm)


def test_release_drops_the_exported_memory(setup, fake_gpu) -> None:
    producer, consumer, ref = setup
    buffer = weakref.ref(fake_gpu.pop().buffer)
    assert buffer() is not None
    assert producer.release([ref.cuda_ipc.lease_id]) == 1
    gc.collect()
    assert buffer() is None
    assert producer.release([ref.cuda_ipc.lease_id]) == 0
    with pytest.raises(NotFound):
        consumer.import_tensor_sync(ref)


def test_expired_lease_drops_the_exported_memory(make_transport, fake_gpu) -> None:
    producer = make_transport(inline_threshold=0, lease_ttl_s=0.05)
    ref = producer.export("x", torch.ones(100), consumer=ON_GPU)
    buffer = weakref.ref(fake_gpu.pop().buffer)
    time.sleep(0.1)
    producer.reap()  # unless the reaper thread was first
    assert producer.live_leases() == 0
    gc.collect()
    assert buffer() is None
    with pytest.raises(NotFound):
        producer.read_lease(ref.cuda_ipc.lease_id, 0, 100)


def test_failed_export_of_a_state_releases_its_gpu_leases(make_transport, fake_gpu) -> None:
    producer = make_transport(inline_threshold=0, max_tensor_bytes=100)
    with pytest.raises(ResourceExhausted):
        producer.export_state({"a": torch.ones(10), "b": torch.ones(100)}, {}, consumer=ON_GPU)
    assert len(fake_gpu) == 1 and producer.live_leases() == 0


def test_share_failure_falls_back_to_shm_with_one_warning(
    make_transport, fake_gpu, monkeypatch, caplog
) -> None:
    def refuse(tensor: torch.Tensor) -> cuda_ipc.Shared:
        raise RuntimeError("cudaMallocAsync does not yet support shareIpcHandle")

    monkeypatch.setattr(cuda_ipc, "share", refuse)
    producer = make_transport(inline_threshold=0)
    with caplog.at_level(logging.INFO, "omnistage.transport"):
        refs = [producer.export(f"t{i}", torch.ones(100), consumer=ON_GPU) for i in range(3)]
    assert [r.WhichOneof("location") for r in refs] == ["shm"] * 3
    [record] = ours(caplog)
    assert record.levelno == logging.WARNING and "shareIpcHandle" in record.getMessage()


def test_consumer_that_cannot_open_fetches_from_the_producer(make_transport, fake_gpu, caplog) -> None:
    """Routed to a replica off the producer's GPU, the request still gets its bytes, once
    copied from the GPU by the producer's TensorStore."""
    t = torch.randn(3, 1000, 100).to(torch.bfloat16)

    async def main() -> None:
        producer = make_transport(inline_threshold=0)
        consumer = make_transport()
        server = aio_server()
        add_tensor_store(server, producer)
        producer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            state = producer.export_state({"x": t}, {"k": "v"}, consumer=ON_GPU)
            assert state.tensors[0].WhichOneof("location") == "cuda_ipc"
            with caplog.at_level(logging.INFO, "omnistage.transport"):
                got, meta = await consumer.import_state(state)
                await consumer.import_state(state)
            assert got["x"].dtype == torch.bfloat16 and torch.equal(got["x"], t) and meta == {"k": "v"}
            [record] = ours(caplog)
            assert "fetches" in record.getMessage()
            producer.release(producer.lease_ids(state))
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_cuda_ipc_ref_without_an_address_cannot_fall_back(setup, make_transport) -> None:
    producer, consumer, _ = setup
    producer.address = ""
    ref = producer.export("y", torch.ones(100), consumer=ON_GPU)
    with pytest.raises(OmniError) as info:
        asyncio.run(consumer.import_state(tensor_pb2.StageState(tensors=[ref])))
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
