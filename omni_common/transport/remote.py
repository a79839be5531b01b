"""TensorStore's consumer side: pull a producer's tensor in chunks over gRPC (across hosts, or
where this process cannot map the producer's memory), and ask a producer to end leases. The
producer's side is omni_common.transport.store."""

from __future__ import annotations

import asyncio
import weakref

import grpc
import grpc.aio
import numpy as np
import torch

from omni_common.errors import InvalidArgument, NotFound, OmniError, error_from_rpc
from omni_common.net.auth import cluster_metadata
from omni_common.net.rpc import CHUNK_BYTES, aio_channel
from omnistage.v1 import tensor_pb2, tensor_pb2_grpc

from .codec import check_header, empty_for
from .lease_table import parse_lease_id

# Channels belong to the event loop that made them; keep one per (loop, address).
_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, grpc.aio.Channel]] = (
    weakref.WeakKeyDictionary()
)


def _stub(address: str) -> tensor_pb2_grpc.TensorStoreStub:
    per_loop = _channels.setdefault(asyncio.get_running_loop(), {})
    channel = per_loop.get(address)
    if channel is None:
        channel = per_loop[address] = aio_channel(address, metadata=cluster_metadata())
    return tensor_pb2_grpc.TensorStoreStub(channel)


async def fetch_remote(
    ref: tensor_pb2.TensorRef, max_tensor_bytes: int, chunk_bytes: int = CHUNK_BYTES
) -> torch.Tensor:
    """Pull the tensor behind a RemoteRef (or a CudaIpcRef or ShmRef this process cannot open)
    from its producer into a fresh CPU tensor."""
    dtype, shape = check_header(ref, max_tensor_bytes)
    kind = ref.WhichOneof("location")
    where = ref.cuda_ipc if kind == "cuda_ipc" else ref.shm if kind == "shm" else ref.remote
    parse_lease_id(where.lease_id)
    if not where.producer_address:
        raise InvalidArgument(f"tensor {ref.name!r}: remote ref without a producer address")
    t, dst = empty_for(dtype, shape)
    stub = _stub(where.producer_address)
    request = tensor_pb2.FetchRequest(lease_id=where.lease_id, chunk_bytes=chunk_bytes)
    received = 0
    try:
        async for chunk in stub.Fetch(request):
            end = received + len(chunk.data)
            if chunk.offset != received or end > ref.nbytes:
                raise OmniError(
                    f"tensor {ref.name!r}: producer sent a chunk out of place",
                    grpc.StatusCode.DATA_LOSS,
                )
            dst[received:end] = np.frombuffer(chunk.data, dtype=np.uint8)
            received = end
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            # The producer is gone (killed, or its host is): so is the tensor. NOT_FOUND tells
            # the caller to produce it again, where UNAVAILABLE would blame this replica.
            raise NotFound(
                f"tensor {ref.name!r}: its producer at {where.producer_address} cannot be reached"
            ) from None
        raise error_from_rpc(e) from None
    if received != ref.nbytes:
        raise OmniError(
            f"tensor {ref.name!r}: producer sent {received} of {ref.nbytes} bytes",
            grpc.StatusCode.DATA_LOSS,
        )
    return t


async def release_remote(address: str, lease_ids: list[str], request_id: str = "") -> int:
    """Ask the producer at `address` to release leases (and those of the results it sent for
    `request_id`); returns how many were live."""
    try:
        reply = await _stub(address).Release(
            tensor_pb2.ReleaseRequest(lease_ids=lease_ids, request_id=request_id)
        )
    except grpc.aio.AioRpcError as e:
        raise error_from_rpc(e) from None
    return int(reply.released)
