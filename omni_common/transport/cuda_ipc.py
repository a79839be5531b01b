"""CUDA IPC: a device tensor handed to another process on the same GPU without a copy.

Producer (`share`): the tensor is cloned into a fresh allocation, because the transport
cannot know whether the caller reuses its buffer (a prompt cache, a CUDA graph's static
output) and CUDA refuses to re-export memory that was itself imported. PyTorch's caching
allocator gives the IPC handle of the cudaMalloc segment that holds the clone plus the
clone's offset in it, and records an interprocess event after the clone. The lease keeps
the clone; dropping it frees the memory.

PyTorch's own sharing (torch.multiprocessing) also counts, in a shared-memory file, one
open per send, and parks freed memory until that count drops. A lease may be opened by
several consumers (a retry on another replica) or by none (a cancelled request), so that
count would be wrong both ways: the producer hands it back at once and the lease alone
decides when the memory goes. Consumers open with a counter name that does not exist
(PyTorch tolerates that), so a ref can never make a consumer touch another process's
counters.

Consumer (`open_ipc`): every field is checked against the producer's lease table before
CUDA sees any of it; then the segment is mapped on this process's device with that GPU's
UUID, the current stream waits for the producer's event, and the tensor aliases the
producer's memory. The consumer must not write to it, and must finish with it (GPU work
queued on its streams included: `wait_for_queued_work`) before the lease ends.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import torch

from omni_common.errors import Aborted, InvalidArgument, OmniError, PermissionDenied
from omnistage.v1 import tensor_pb2

from .codec import check_header
from .lease_table import CUDA_SEGMENT, parse_lease_id, read_seq
from .peers import PeerMaps, live_slot
from .route import gpu_uuid, local_cuda_index

# PyTorch's handle: a version byte, a type byte ('c': cudaMalloc, 'e': expandable segment),
# then the 64-byte cudaIpcMemHandle_t. Anything much longer is not a handle.
MAX_HANDLE_BYTES = 256
EXPANDABLE_SEGMENT = b"e"
EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
NO_COUNTER = b"/omnistage-no-ipc-counter"


class CannotOpenHere(OmniError):
    """A valid CudaIpcRef that this process cannot map (no CUDA, GPU not visible, CUDA
    refused); the bytes can still be fetched from the producer."""


@dataclass
class Shared:
    """A device tensor exported by CUDA IPC: what the ref carries and what the lease keeps."""

    buffer: torch.Tensor  # the exported clone; the lease holds it, dropping it frees the memory
    gpu_uuid: str
    handle: bytes
    offset: int  # of the clone inside the segment the handle names
    event: bytes  # b"" when PyTorch synchronized the stream instead of recording an event


def share(tensor: torch.Tensor) -> Shared:
    """Clone a CUDA tensor and export the clone; RuntimeError when the allocator cannot."""
    buffer = tensor.detach().clone(memory_format=torch.contiguous_format)
    storage = buffer.untyped_storage()
    _, handle, _, offset, counter, counter_offset, event, event_needed = storage._share_cuda_()
    torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)  # see the module doc
    if handle[1:2] == EXPANDABLE_SEGMENT:  # settings changed at run time, past allocator_refusal
        raise RuntimeError("the memory is in an expandable segment")
    return Shared(
        buffer, gpu_uuid(buffer.device), bytes(handle), int(offset), bytes(event) if event_needed else b""
    )


def digest(gpu: str, handle: bytes, event: bytes, offset: int, nbytes: int) -> int:
    """What the lease table keeps of a CUDA handle: any other handle, event, GPU or region
    under the same lease id fails the check. Never 0 (0 marks an shm lease)."""
    h = hashlib.blake2b(digest_size=8)
    for part in (gpu.encode(), handle, event):
        h.update(len(part).to_bytes(4, "little") + part)
    h.update(offset.to_bytes(8, "little") + nbytes.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") or 1


def fill_ref(ref: tensor_pb2.TensorRef, shared: Shared, lease_id: str, producer_address: str) -> None:
    ipc = ref.cuda_ipc
    ipc.gpu_uuid = shared.gpu_uuid
    ipc.ipc_handle = shared.handle
    ipc.offset = shared.offset
    ipc.nbytes = ref.nbytes
    ipc.lease_id = lease_id
    ipc.event_handle = shared.event
    ipc.producer_address = producer_address


def _device_for(name: str, uuid: str) -> int:
    """This process's index of the GPU that holds the memory (it need not be the worker's:
    a tensor opened on another visible GPU is copied over by the runner's .to(device))."""
    if not torch.cuda.is_available():
        raise CannotOpenHere(
            f"tensor {name!r} is in GPU memory (CUDA IPC) and this process has no CUDA",
            grpc.StatusCode.UNIMPLEMENTED,
        )
    index = local_cuda_index(uuid)
    if index is None:
        raise CannotOpenHere(
            f"tensor {name!r} is in the memory of a GPU this process does not see",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    torch.cuda.init()  # as torch.multiprocessing does before _new_shared_cuda
    return index


def open_ipc(ref: tensor_pb2.TensorRef, peers: PeerMaps, max_tensor_bytes: int) -> torch.Tensor:
    """A device tensor over the memory behind a CudaIpcRef (no copy), checked first."""
    dtype, shape = check_header(ref, max_tensor_bytes)
    ipc = ref.cuda_ipc
    key = parse_lease_id(ipc.lease_id)
    if ipc.nbytes != ref.nbytes:
        raise InvalidArgument(f"tensor {ref.name!r}: cuda_ipc nbytes does not match the tensor")
    if len(ipc.ipc_handle) > MAX_HANDLE_BYTES or len(ipc.event_handle) not in (0, EVENT_HANDLE_BYTES):
        raise InvalidArgument(f"tensor {ref.name!r}: malformed CUDA IPC handle")
    table, slot = live_slot(peers, key, ref.name, ipc.lease_id)
    expected = digest(ipc.gpu_uuid, ipc.ipc_handle, ipc.event_handle, ipc.offset, ipc.nbytes)
    if (slot.segment, slot.offset, slot.nbytes, slot.digest) != (
        CUDA_SEGMENT,
        ipc.offset,
        ipc.nbytes,
        expected,
    ):
        raise PermissionDenied(f"tensor {ref.name!r}: handle does not match its lease")
    device = _device_for(ref.name, ipc.gpu_uuid)
    try:
        if ipc.event_handle:
            # Waited on here rather than by _new_shared_cuda, which never destroys the event
            # it opens; this one is destroyed with the object (pending waits still hold).
            event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), ipc.event_handle)
            event.wait(torch.cuda.current_stream(device))
        storage = torch.UntypedStorage._new_shared_cuda(
            device, ipc.ipc_handle, ipc.nbytes, ipc.offset, NO_COUNTER, 0, bytes(EVENT_HANDLE_BYTES), False
        )
    except RuntimeError as e:
        # CUDA's own words (no path or key in them): e.g. IPC across containers refused.
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CannotOpenHere(
            f"tensor {ref.name!r}: CUDA could not open the IPC handle ({reason})",
            grpc.StatusCode.FAILED_PRECONDITION,
        ) from None
    if read_seq(table, key.slot) != slot.seq:
        raise Aborted(f"tensor {ref.name!r}: lease released while opening")
    flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage)
    return flat.view(dtype).reshape(shape)


def lease_bytes(buffer: torch.Tensor, start: int, end: int) -> bytes:
    """Bytes [start, end) of an exported device buffer, copied to the host (the fetch path
    of a consumer that cannot open the handle)."""
    return buffer.reshape(-1).view(torch.uint8)[start:end].cpu().numpy().tobytes()


async def wait_for_queued_work(tensors: Iterable[torch.Tensor]) -> None:
    """Wait, off the event loop, until the GPU has run the work queued so far on the devices
    of these tensors: after that, the leases of imported device tensors may end.

    The event goes on the caller's current stream, which is also the compute thread's
    (PyTorch's default stream, unless a worker sets another one).
    """
    events = []
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        event = torch.cuda.Event(blocking=True)  # sleeps in synchronize instead of spinning
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    for event in events:
        await asyncio.to_thread(event.synchronize)
