"""TensorTransport: one per process; turns tensors into TensorRefs and back.

Small tensors travel inline. A larger tensor on a GPU goes by CUDA IPC when its consumer
is on the same GPU (route.py says when); otherwise it is copied into this process's shm
arena under a lease and handed out as a ShmRef (same host) or a RemoteRef (other hosts
fetch it from our TensorStore). Every export but inline is leased. Imports of small
tensors copy; large shm imports map the region copy-on-write and CUDA IPC imports alias
the producer's memory, both valid while the lease is held.
"""

from __future__ import annotations

import asyncio
import atexit
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from omni_common.errors import (
    InvalidArgument,
    NotFound,
    OmniError,
    ResourceExhausted,
    Unavailable,
)
from omnistage.v1 import tensor_pb2

from . import cuda_ipc
from .arena import ShmArena
from .codec import byte_array, copy_bytes, decode_inline, dtype_name, encode_inline, host_contiguous
from .lease_table import CUDA_SEGMENT, LeaseKey, LeaseTable, parse_lease_id, short, sweep_stale_segments
from .peers import PeerMaps, import_shm
from .remote import fetch_remote
from .route import Consumer, host_id_default, say_once, use_cuda_ipc

# Above this size an import runs in a worker thread so the event loop keeps serving.
_THREAD_COPY_BYTES = 4 << 20
SENT_REQUESTS = 4096  # requests whose sent results release_request can still end
SAME_HOST = Consumer()


@dataclass
class Lease:
    nonce: int
    segment: int  # CUDA_SEGMENT for GPU memory
    offset: int
    nbytes: int
    generation: int
    expires_at: float
    device_buffer: torch.Tensor | None = None  # the exported GPU memory (CUDA IPC)


class TensorTransport:
    """One per process. Owns the process's shm arena + lease table."""

    def __init__(
        self,
        *,
        address: str = "",
        host_id: str | None = None,
        shm_dir: Path | str = "/dev/shm",
        segment_bytes: int = 256 << 20,
        lease_ttl_s: float = 600.0,
        inline_threshold: int = 64 << 10,
        max_tensor_bytes: int = 4 << 30,
    ) -> None:
        self.address = address
        self.host_id = host_id or host_id_default()
        self.shm_dir = Path(shm_dir)
        self.lease_ttl_s = lease_ttl_s
        self.inline_threshold = inline_threshold
        self.max_tensor_bytes = max_tensor_bytes
        self.token = secrets.token_hex(8)
        sweep_stale_segments(self.shm_dir)
        self._arena = ShmArena(self.shm_dir, self.token, segment_bytes)
        self._table: LeaseTable | None = None  # made on the first leased export
        self._leases: dict[int, Lease] = {}
        # Lease ids of the results sent per request id, newest last (release_request).
        self._sent: OrderedDict[str, list[str]] = OrderedDict()
        self._generation = 0
        self._lock = threading.RLock()
        self._closed = False
        self._peers = PeerMaps(self.shm_dir)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        atexit.register(self.close)

    # ---- producer side ---------------------------------------------------------------

    def export(
        self, name: str, tensor: torch.Tensor, *, consumer: Consumer = SAME_HOST
    ) -> tensor_pb2.TensorRef:
        """A TensorRef for `tensor`: inline when small; else leased GPU memory (CUDA IPC) when
        `consumer` is on the same GPU, or a leased copy in the shm arena."""
        dtype = dtype_name(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.inline_threshold:
            return encode_inline(name, tensor)
        if nbytes > self.max_tensor_bytes:
            raise ResourceExhausted(
                f"tensor {name!r}: {nbytes} bytes exceeds the limit of {self.max_tensor_bytes}"
            )
        ref = tensor_pb2.TensorRef(name=name, dtype=dtype, shape=list(tensor.shape), nbytes=nbytes)
        if use_cuda_ipc(consumer, self.host_id, tensor.device):
            shared = _share(tensor)
            if shared is not None:
                return self._lease_shared(ref, shared)
        remote = consumer.host_id not in ("", self.host_id)
        if remote and not self.address:
            raise OmniError(
                "this process has no TensorStore address for remote consumers",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        t = host_contiguous(tensor)
        segment, offset = self._arena.allocate(nbytes)
        try:
            # Copy outside the lock: the region is ours until a lease names it.
            dst = np.frombuffer(self._arena.view(segment), np.uint8, nbytes, offset)
            copy_bytes(dst, byte_array(t))
            del dst
            with self._lock:
                lease_id, generation = self._book(segment, offset, nbytes)
        except BaseException:
            self._arena.free(segment, offset, nbytes)
            raise
        if remote:
            ref.remote.producer_address = self.address
            ref.remote.lease_id = lease_id
        else:
            ref.shm.arena_id = f"{self.token}-{segment}"
            ref.shm.offset = offset
            ref.shm.nbytes = nbytes
            ref.shm.lease_id = lease_id
            ref.shm.generation = generation
            ref.shm.producer_address = self.address
        return ref

    def _lease_shared(self, ref: tensor_pb2.TensorRef, shared: cuda_ipc.Shared) -> tensor_pb2.TensorRef:
        """Book a lease on exported GPU memory and point `ref` at it."""
        digest = cuda_ipc.digest(shared.gpu_uuid, shared.handle, shared.event, shared.offset, ref.nbytes)
        with self._lock:
            lease_id, _ = self._book(CUDA_SEGMENT, shared.offset, ref.nbytes, digest, shared.buffer)
        cuda_ipc.fill_ref(ref, shared, lease_id, self.address)
        return ref

    def export_state(
        self, tensors: dict[str, torch.Tensor], meta: dict[str, str], *, consumer: Consumer = SAME_HOST
    ) -> tensor_pb2.StageState:
        """Export every tensor; on failure the leases already made are released."""
        state = tensor_pb2.StageState(meta=meta)
        try:
            for name, tensor in tensors.items():
                state.tensors.append(self.export(name, tensor, consumer=consumer))
        except BaseException:
            self.release(self.lease_ids(state))
            raise
        return state

    def release(self, lease_ids: Iterable[str]) -> int:
        """Free this process's leases among `lease_ids`; unknown ones are ignored."""
        released = 0
        for lease_id in lease_ids:
            try:
                key = parse_lease_id(lease_id)
            except InvalidArgument:
                continue
            if key.token == self.token and self._free(key):
                released += 1
        return released

    def sent(self, request_id: str, lease_ids: list[str]) -> None:
        """`lease_ids` went out in a result for `request_id`: release_request may end them."""
        with self._lock:
            self._sent.setdefault(request_id, []).extend(lease_ids)
            self._sent.move_to_end(request_id)
            while len(self._sent) > SENT_REQUESTS:
                self._sent.popitem(last=False)  # long read or expired: their TTL ends them

    def release_request(self, request_id: str) -> int:
        """Free the leases of the results sent for `request_id` (ReleaseRequest.request_id)."""
        with self._lock:
            lease_ids = self._sent.pop(request_id, [])
        return self.release(lease_ids)

    def live_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def read_lease(self, lease_id: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of a live lease (TensorStore.Fetch uses this)."""
        key = parse_lease_id(lease_id)
        with self._lock:
            lease = self._live(key)
            if lease is None:
                raise NotFound(f"lease {short(lease_id)} not found or expired")
            end = min(lease.nbytes, offset + length)
            buffer = lease.device_buffer
            if buffer is None:
                start = lease.offset + offset
                return self._arena.view(lease.segment)[start : lease.offset + end]
        # Copy from the GPU outside the lock; the reference keeps the memory meanwhile.
        return cuda_ipc.lease_bytes(buffer, offset, end)

    def lease_nbytes(self, lease_id: str) -> int:
        """Size of a live lease; NotFound when unknown or expired."""
        key = parse_lease_id(lease_id)
        with self._lock:
            lease = self._live(key)
            if lease is None:
                raise NotFound(f"lease {short(lease_id)} not found or expired")
            return lease.nbytes

    def close(self) -> None:
        """Release everything and unlink this process's segments (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._leases.clear()
            if self._table is not None:
                self._table.close()
            self._arena.close()
            self._peers.close()
        atexit.unregister(self.close)

    # ---- consumer side ---------------------------------------------------------------

    def import_tensor_sync(self, ref: tensor_pb2.TensorRef) -> torch.Tensor:
        """The tensor of an inline, shm or CUDA IPC TensorRef (no network): a CPU tensor, or
        for CUDA IPC a device tensor over the producer's memory."""
        kind = ref.WhichOneof("location")
        if kind == "inline_data" or (kind is None and ref.nbytes == 0):
            return decode_inline(ref, self.max_tensor_bytes)
        if kind == "shm":
            return import_shm(ref, self._peers, self.max_tensor_bytes)
        if kind == "cuda_ipc":
            return cuda_ipc.open_ipc(ref, self._peers, self.max_tensor_bytes)
        if kind == "remote":
            raise InvalidArgument(f"tensor {ref.name!r}: a remote tensor needs import_state")
        raise InvalidArgument(f"tensor {ref.name!r}: no location")

    async def import_state(
        self, state: tensor_pb2.StageState
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Decode every TensorRef of a state into tensors this process owns."""
        names = [ref.name for ref in state.tensors]
        if len(set(names)) != len(names):
            raise InvalidArgument("duplicate tensor names in stage state")

        async def one(ref: tensor_pb2.TensorRef) -> torch.Tensor:
            kind = ref.WhichOneof("location")
            if kind == "remote":
                return await fetch_remote(ref, self.max_tensor_bytes)
            if kind == "cuda_ipc":
                try:
                    return self.import_tensor_sync(ref)  # a mapping, not a copy: no thread
                except cuda_ipc.CannotOpenHere as err:
                    if not ref.cuda_ipc.producer_address:
                        raise
                    # Routed to a replica off the producer's GPU: still served, at fetch speed.
                    say_once(f"this process cannot open CUDA IPC handles ({err.code.name}); it fetches them")
                    return await fetch_remote(ref, self.max_tensor_bytes)
            if kind == "shm" and ref.shm.producer_address and self._peers.elsewhere(ref.shm):
                # Made for a consumer on the producer's host, routed to another (failover).
                return await fetch_remote(ref, self.max_tensor_bytes)
            if ref.nbytes >= _THREAD_COPY_BYTES:
                return await asyncio.to_thread(self.import_tensor_sync, ref)
            return self.import_tensor_sync(ref)

        tensors = await asyncio.gather(*(one(ref) for ref in state.tensors))
        return dict(zip(names, tensors, strict=True)), dict(state.meta)

    @staticmethod
    async def finish_imports(tensors: Iterable[torch.Tensor]) -> None:
        """Return once the GPU has run the work queued so far on imported device tensors:
        from then on their leases may end. A stage calls it before it answers, since the
        coordinator releases its inputs' leases when it hears the answer."""
        await cuda_ipc.wait_for_queued_work(tensors)

    @staticmethod
    def lease_ids(state: tensor_pb2.StageState) -> list[str]:
        """Leases named in a state (what the coordinator releases when a request ends)."""
        out = []
        for ref in state.tensors:
            kind = ref.WhichOneof("location")
            if kind == "shm":
                out.append(ref.shm.lease_id)
            elif kind == "remote":
                out.append(ref.remote.lease_id)
            elif kind == "cuda_ipc":
                out.append(ref.cuda_ipc.lease_id)
        return out

    # ---- internals -------------------------------------------------------------------

    def _open_table(self) -> LeaseTable:
        if self._closed:
            raise Unavailable("tensor transport is closed")
        if self._table is None:
            self._table = LeaseTable(self.shm_dir, self.token)
            self._reaper = threading.Thread(
                target=self._reap_loop, daemon=True, name="omnistage-lease-reaper"
            )
            self._reaper.start()
        return self._table

    def _live(self, key: LeaseKey) -> Lease | None:
        if key.token != self.token:
            return None
        lease = self._leases.get(key.slot)
        if lease is None or lease.nonce != key.nonce or lease.expires_at <= time.time():
            return None
        return lease

    def _free(self, key: LeaseKey) -> bool:
        with self._lock:
            lease = self._leases.get(key.slot)
            if lease is None or lease.nonce != key.nonce:
                return False
            self._drop(key.slot, lease)
            return True

    def _book(
        self,
        segment: int,
        offset: int,
        nbytes: int,
        digest: int = 0,
        device_buffer: torch.Tensor | None = None,
    ) -> tuple[str, int]:
        """Write a lease for a region (the caller holds the lock); returns (lease id, generation)."""
        table = self._open_table()
        self._generation += 1
        lease_id = table.add(segment, offset, nbytes, self._generation, self.lease_ttl_s, digest)
        key = parse_lease_id(lease_id)
        expires_at = time.time() + self.lease_ttl_s
        self._leases[key.slot] = Lease(
            key.nonce, segment, offset, nbytes, self._generation, expires_at, device_buffer
        )
        return lease_id, self._generation

    def _drop(self, slot: int, lease: Lease) -> None:
        del self._leases[slot]
        if self._table is not None:
            self._table.clear(slot)
        if lease.device_buffer is not None:
            lease.device_buffer = None  # the GPU memory goes now (or when a Fetch copy ends)
        else:
            self._arena.free(lease.segment, lease.offset, lease.nbytes)

    def reap(self) -> int:
        """Free expired leases now; returns how many."""
        now = time.time()
        with self._lock:
            expired = [(s, lease) for s, lease in self._leases.items() if lease.expires_at <= now]
            for slot, lease in expired:
                self._drop(slot, lease)
        return len(expired)

    def _reap_loop(self) -> None:
        interval = min(max(self.lease_ttl_s / 4, 0.05), 5.0)
        while not self._stop.wait(interval):
            self.reap()


def _share(tensor: torch.Tensor) -> cuda_ipc.Shared | None:
    """Export a CUDA tensor by IPC, or None (said once) when PyTorch's allocator cannot."""
    try:
        return cuda_ipc.share(tensor)
    except RuntimeError as err:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        say_once(f"PyTorch cannot export this memory by CUDA IPC ({detail})", warn=True)
        return None
