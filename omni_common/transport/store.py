"""TensorStore's server side: a producer serves its leases' bytes in chunks (Fetch) and ends
leases on request (Release). The consumer's side is omni_common.transport.remote."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio

from omni_common.errors import OmniError
from omni_common.net.rpc import CHUNK_BYTES, MAX_MESSAGE_BYTES
from omnistage.v1 import tensor_pb2, tensor_pb2_grpc

from .transport import TensorTransport

# Room for the chunk's own framing under the message limit.
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - (64 << 10)


class TensorStoreServicer(tensor_pb2_grpc.TensorStoreServicer):
    """Serves the leases of one TensorTransport."""

    def __init__(self, transport: TensorTransport) -> None:
        self.transport = transport

    async def Fetch(
        self, request: tensor_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tensor_pb2.TensorChunk]:
        chunk = min(request.chunk_bytes or CHUNK_BYTES, MAX_CHUNK_BYTES)
        try:
            nbytes = self.transport.lease_nbytes(request.lease_id)
        except OmniError as e:
            await context.abort(e.code, e.message)
            return
        offset = 0
        while offset < nbytes:
            try:
                # Each read checks the lease again: a release mid-stream ends the stream.
                data = self.transport.read_lease(request.lease_id, offset, chunk)
            except OmniError as e:
                await context.abort(grpc.StatusCode.ABORTED, f"lease ended while reading: {e}")
                return
            yield tensor_pb2.TensorChunk(offset=offset, data=data)
            offset += len(data)

    async def Release(
        self, request: tensor_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> tensor_pb2.ReleaseResponse:
        released = self.transport.release(request.lease_ids)
        if request.request_id:
            released += self.transport.release_request(request.request_id[:128])
        return tensor_pb2.ReleaseResponse(released=released)


def add_tensor_store(server: grpc.aio.Server, transport: TensorTransport) -> None:
    """Serve `transport`'s leases on `server`."""
    tensor_pb2_grpc.add_TensorStoreServicer_to_server(TensorStoreServicer(transport), server)
