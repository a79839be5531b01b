"""The consumer's side of a ShmRef: map the producer's files read-only and check the handle.

Every check happens before a byte is read: the arena id and lease id are matched by strict
patterns (the path is built from them, never taken from the request), the lease is looked
up in the producer's table, and offset + nbytes is checked against the file's real size.
Small tensors are copied, and the slot is read again after the copy, so a lease released
mid-copy is reported. Large tensors (ZERO_COPY_BYTES and up) are not copied: the consumer
gets a private copy-on-write mapping of the region, valid while the lease is held (the
lease contract: the producer frees the region only on release or expiry), and its own
writes never reach the producer.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni_common.errors import (
    Aborted,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from omnistage.v1 import tensor_pb2

from .arena import ARENA_ID_RE, close_map, segment_path
from .codec import check_header, copy_bytes, empty_for
from .lease_table import LeaseKey, LeaseSlot, capacity_of, parse_lease_id, read_seq, read_slot, short


@dataclass
class _Mapped:
    mm: mmap.mmap
    ino: tuple[int, int]
    size: int


class PeerMaps:
    """A bounded LRU of read-only mappings of other processes' segments."""

    def __init__(self, shm_dir: Path, limit: int = 64) -> None:
        self.shm_dir = shm_dir
        self.limit = limit
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self._lock = threading.Lock()

    def elsewhere(self, shm: tensor_pb2.ShmRef) -> bool:
        """Whether a well-formed handle (its lease of its arena's producer) names a producer
        whose lease table is not in this shared-memory directory: one on another host. False
        for anything malformed or forged, which import_shm then refuses."""
        arena = ARENA_ID_RE.fullmatch(shm.arena_id)
        try:
            key = parse_lease_id(shm.lease_id)
        except InvalidArgument:
            return False
        if arena is None or key.token != arena.group(1):
            return False
        return not segment_path(self.shm_dir, key.token, "leases").exists()

    def get(self, token: str, index: int | str) -> _Mapped | None:
        """The mapping of a segment, None when the file does not exist."""
        key = f"{token}-{index}"
        path = segment_path(self.shm_dir, token, index)
        with self._lock:
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                self._drop(key)
                return None
            cached = self._maps.get(key)
            if cached is not None and cached.ino == (st.st_dev, st.st_ino):
                self._maps.move_to_end(key)
                return cached
            self._drop(key)  # the file was replaced (or never mapped)
            mapped = self._open(path)
            if mapped is None:
                return None
            self._maps[key] = mapped
            while len(self._maps) > self.limit:
                _, old = self._maps.popitem(last=False)
                close_map(old.mm)
            return mapped

    def _open(self, path: Path) -> _Mapped | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PermissionDenied("cannot open the producer's arena") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise PermissionDenied("the producer's arena is not a shared-memory segment")
            # Populate the page tables once: cached maps are then read without faults.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, st.st_size, flags, mmap.PROT_READ)
            return _Mapped(mm, (st.st_dev, st.st_ino), st.st_size)
        finally:
            os.close(fd)

    def _drop(self, key: str) -> None:
        old = self._maps.pop(key, None)
        if old is not None:
            close_map(old.mm)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                close_map(m.mm)
            self._maps.clear()


ZERO_COPY_BYTES = 1 << 20
PAGE = mmap.ALLOCATIONGRANULARITY


def _map_private(
    peers: PeerMaps, token: str, segment: int, offset: int, nbytes: int, ino: tuple[int, int]
) -> torch.Tensor:
    """A uint8 tensor over a copy-on-write mapping of [offset, offset + nbytes)."""
    path = segment_path(peers.shm_dir, token, segment)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFound("unknown arena") from None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ino or offset + nbytes > st.st_size:
            raise Aborted("the producer's arena changed while mapping")
        start = offset - offset % PAGE
        mm = mmap.mmap(
            fd, offset + nbytes - start, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=start
        )
    finally:
        os.close(fd)
    # The tensor keeps the mapping alive; it is unmapped when the last view is gone.
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset - start)


def live_slot(peers: PeerMaps, key: LeaseKey, name: str, lease_id: str) -> tuple[mmap.mmap, LeaseSlot]:
    """The producer's lease table and the live slot `key` names; NotFound when the producer,
    the slot or the lease is unknown, or the lease has expired."""
    table = peers.get(key.token, "leases")
    capacity = capacity_of(table.mm) if table is not None else None
    if table is None or capacity is None:
        raise NotFound(f"tensor {name!r}: unknown producer (gone, or not on this host)")
    if key.slot >= capacity:
        raise NotFound(f"tensor {name!r}: lease not found or expired")
    slot = read_slot(table.mm, key.slot)
    if slot.nonce != key.nonce or slot.expires_at <= time.time():
        raise NotFound(f"tensor {name!r}: lease {short(lease_id)} not found or expired")
    return table.mm, slot


def import_shm(ref: tensor_pb2.TensorRef, peers: PeerMaps, max_tensor_bytes: int) -> torch.Tensor:
    """Copy the tensor behind a ShmRef into a fresh tensor, checking the handle first."""
    dtype, shape = check_header(ref, max_tensor_bytes)
    shm = ref.shm
    arena = ARENA_ID_RE.fullmatch(shm.arena_id)
    if arena is None:
        raise InvalidArgument(f"tensor {ref.name!r}: malformed arena id")
    key = parse_lease_id(shm.lease_id)
    if key.token != arena.group(1):
        raise PermissionDenied(f"tensor {ref.name!r}: lease does not belong to this arena")
    if shm.nbytes != ref.nbytes:
        raise InvalidArgument(f"tensor {ref.name!r}: shm nbytes does not match the tensor")
    table, slot = live_slot(peers, key, ref.name, shm.lease_id)
    if (slot.segment, slot.offset, slot.nbytes, slot.generation) != (
        int(arena.group(2)),
        shm.offset,
        shm.nbytes,
        shm.generation,
    ):
        raise PermissionDenied(f"tensor {ref.name!r}: handle does not match its lease")
    seg = peers.get(key.token, slot.segment)
    if seg is None:
        raise NotFound(f"tensor {ref.name!r}: unknown arena")
    if shm.offset > seg.size or shm.nbytes > seg.size - shm.offset:
        raise PermissionDenied(f"tensor {ref.name!r}: handle is outside its arena")
    if shm.nbytes >= ZERO_COPY_BYTES:
        t = _map_private(peers, key.token, slot.segment, shm.offset, shm.nbytes, seg.ino)
        if read_seq(table, key.slot) != slot.seq:
            raise Aborted(f"tensor {ref.name!r}: lease released while mapping")
        return t.view(dtype).reshape(shape)
    t, dst = empty_for(dtype, shape)
    if shm.nbytes:
        src = np.frombuffer(seg.mm, dtype=np.uint8, count=shm.nbytes, offset=shm.offset)
        copy_bytes(dst, src)
        del src
    if read_seq(table, key.slot) != slot.seq:
        raise Aborted(f"tensor {ref.name!r}: lease released while reading")
    return t
