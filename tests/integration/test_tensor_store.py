"""TensorStore over a real gRPC server on loopback: chunked Fetch, Release, status codes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import grpc
import pytest
import torch

from omni_common.errors import InvalidArgument, NotFound
from omni_common.net.rpc import aio_channel, aio_server
from omni_common.transport import Consumer, TensorTransport, add_tensor_store, release_remote
from omni_common.transport.remote import fetch_remote
from omnistage.v1 import tensor_pb2, tensor_pb2_grpc


def _shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("omnistage-")}


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = _shm_files()
    yield
    assert _shm_files() - before == set()


def with_store(body: Callable[[TensorTransport, str], Awaitable[None]]) -> None:
    async def main() -> None:
        tr = TensorTransport(segment_bytes=1 << 20, inline_threshold=1024)
        server = aio_server()
        add_tensor_store(server, tr)
        port = server.add_insecure_port("127.0.0.1:0")
        tr.address = f"127.0.0.1:{port}"
        await server.start()
        try:
            await body(tr, tr.address)
        finally:
            await server.stop(None)
            tr.close()

    asyncio.run(main())


def test_remote_ref_is_fetched_in_chunks_and_released() -> None:
    async def body(tr: TensorTransport, address: str) -> None:
        t = torch.randn(3, 1000, 100).to(torch.bfloat16)  # 600 KB
        state = tr.export_state({"latents": t}, {"k": "v"}, consumer=Consumer("elsewhere"))
        ref = state.tensors[0]
        assert ref.WhichOneof("location") == "remote" and ref.remote.producer_address == address
        consumer = TensorTransport()
        try:
            got, meta = await consumer.import_state(state)
            small = await fetch_remote(ref, 1 << 30, chunk_bytes=4096)  # ~147 chunks
        finally:
            consumer.close()
        assert meta == {"k": "v"}
        assert torch.equal(got["latents"].view(torch.int16), t.view(torch.int16))
        assert torch.equal(small.view(torch.int16), t.view(torch.int16))
        async with aio_channel(address) as ch:
            chunks = [
                c
                async for c in tensor_pb2_grpc.TensorStoreStub(ch).Fetch(
                    tensor_pb2.FetchRequest(lease_id=ref.remote.lease_id, chunk_bytes=100_000)
                )
            ]
        assert [c.offset for c in chunks] == list(range(0, 600_000, 100_000))
        assert await release_remote(address, tr.lease_ids(state)) == 1
        assert await release_remote(address, tr.lease_ids(state)) == 0
        with pytest.raises(NotFound):
            await fetch_remote(ref, 1 << 30)

    with_store(body)


def test_fetch_status_codes() -> None:
    async def body(tr: TensorTransport, address: str) -> None:
        async with aio_channel(address) as ch:
            stub = tensor_pb2_grpc.TensorStoreStub(ch)
            for lease_id, code in [
                ("../../x", grpc.StatusCode.INVALID_ARGUMENT),
                ("0123456789abcdef-0-" + "1" * 16, grpc.StatusCode.NOT_FOUND),
                (f"{tr.token}-0-" + "1" * 16, grpc.StatusCode.NOT_FOUND),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Fetch(tensor_pb2.FetchRequest(lease_id=lease_id)):
                        pass
                assert info.value.code() == code
                assert lease_id not in (info.value.details() or "")

    with_store(body)


def test_remote_errors_map_to_omni_errors() -> None:
    async def body(tr: TensorTransport, address: str) -> None:
        ref = tr.export("x", torch.ones(10_000), consumer=Consumer("elsewhere"))
        bad = tensor_pb2.TensorRef()
        bad.CopyFrom(ref)
        bad.remote.lease_id = ref.remote.lease_id[:-4] + "0000"
        with pytest.raises(NotFound):
            await fetch_remote(bad, 1 << 30)
        bad.remote.lease_id = "nope"
        with pytest.raises(InvalidArgument):
            await fetch_remote(bad, 1 << 30)
        tr.release([ref.remote.lease_id])

    with_store(body)


def test_a_shm_ref_routed_off_its_host_is_fetched_and_a_gone_producer_is_not_found(tmp_path) -> None:
    """A handle made for a consumer on the producer's host reaches one on another host (a step
    that failed over): it is fetched from the producer's store; once the producer is gone, the
    tensor is NOT_FOUND (produce it again), not UNAVAILABLE (which would blame the consumer)."""

    async def body(tr: TensorTransport, address: str) -> None:
        t = torch.randn(64, 1000)
        state = tr.export_state({"kv": t}, {})
        ref = state.tensors[0]
        assert ref.WhichOneof("location") == "shm" and ref.shm.producer_address == address
        elsewhere = TensorTransport(shm_dir=tmp_path, host_id="another-host")
        try:
            got, _ = await elsewhere.import_state(state)
            assert torch.equal(got["kv"], t)
            gone = tensor_pb2.TensorRef()
            gone.CopyFrom(ref)
            gone.shm.producer_address = "127.0.0.1:1"  # nothing listens there
            with pytest.raises(NotFound, match="cannot be reached"):
                await elsewhere.import_state(tensor_pb2.StageState(tensors=[gone]))
        finally:
            elsewhere.close()
        tr.release(tr.lease_ids(state))

    with_store(body)
