"""ShmQueue: messages between the processes of one replica through a ring in POSIX shared memory.

One writer and one reader per queue (a replica's server process and one of its device worker
processes, each way). A message is a small header (a pickled dataclass of plain values: ids, a
request's parameters, tensor names, dtypes and shapes) followed by the raw bytes of its tensors,
row-major, written once into the ring and copied out once by the reader: tensors are never
pickled. A semaphore per queue wakes the reader (no spinning on a busy CPU); the ring's two
positions live in the segment's header, after the owner's stamp.

The segment is made like the transport arena's (omni_common.transport.arena: our prefix, a random
name, mode 0600) by the process that owns the queue; the other side maps it by path when it
starts, and the owner unlinks the name as soon as both have it mapped (`unlink`). Should the owner
be killed before that, the stamp lets the next process's `sweep_stale_segments` remove it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import torch

from omni_common.transport.arena import close_map, create_segment, segment_path
from omni_common.transport.lease_table import QUEUE_MAGIC
from omni_common.transport.owner import STAMP, stamp

# The owner's stamp (a dead owner's queue is swept), write position (u64), read position (u64)
WRITE_AT = STAMP.size
READ_AT = WRITE_AT + 8
HEADER = 64
LENGTH = struct.Struct("<Q")
WRAP = (1 << 64) - 1  # a length that says: the rest of the ring is unused, go to its start
_KNOWN = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in _KNOWN}


@dataclass(frozen=True)
class TensorSpec:
    """Where a message's tensor lies in its payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ShmQueue:
    """A single-writer, single-reader ring of messages in one shared-memory segment."""

    def __init__(self, context: SpawnContext, capacity: int, shm_dir: str = "/dev/shm") -> None:
        self.capacity = capacity
        self.path = segment_path(Path(shm_dir), secrets.token_hex(8), "queue")
        self._mm: mmap.mmap | None = create_segment(self.path, HEADER + capacity)
        self._mm[: STAMP.size] = stamp(QUEUE_MAGIC)
        self._owner = os.getpid()
        self.items = context.Semaphore(0)

    def __getstate__(self) -> dict[str, Any]:  # sent to a worker process when it is spawned
        return {"capacity": self.capacity, "path": self.path, "items": self.items, "owner": self._owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.capacity, self.path, self.items, self._owner = (
            state["capacity"],
            state["path"],
            state["items"],
            state["owner"],
        )
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._mm = mmap.mmap(
                fd, HEADER + self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)

    @property
    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise RuntimeError("the queue is closed")
        return self._mm

    def _positions(self) -> tuple[int, int]:
        return LENGTH.unpack_from(self._map, WRITE_AT)[0], LENGTH.unpack_from(self._map, READ_AT)[0]

    def put(
        self,
        header: object,
        tensors: dict[str, torch.Tensor] | None = None,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """Write one message; waits while the reader has not made room (`alive` says whether
        waiting still makes sense)."""
        tensors = tensors or {}
        host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        specs = [
            TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.nbytes)
            for name, t in host.items()
        ]
        head = pickle.dumps((header, specs), protocol=pickle.HIGHEST_PROTOCOL)
        size = LENGTH.size + len(head) + sum(spec.nbytes for spec in specs)
        body = LENGTH.size + size
        if body > self.capacity // 2:
            raise ValueError(f"a message of {size} bytes does not fit a queue of {self.capacity} bytes")
        mm = self._map
        write, _ = self._positions()
        offset = write % self.capacity
        skip = self.capacity - offset if offset + body > self.capacity else 0
        while True:
            _, read = self._positions()
            if self.capacity - (write - read) >= skip + body:
                break
            if not alive():
                raise BrokenPipeError("the reader of this queue is gone")
            time.sleep(0.0005)
        if skip:
            if skip >= LENGTH.size:
                LENGTH.pack_into(mm, HEADER + offset, WRAP)
            write += skip
            offset = 0
        at = HEADER + offset
        LENGTH.pack_into(mm, at, size)
        LENGTH.pack_into(mm, at + LENGTH.size, len(head))
        at += 2 * LENGTH.size
        mm[at : at + len(head)] = head
        at += len(head)
        for t in host.values():
            if t.nbytes:
                mm[at : at + t.nbytes] = t.reshape(-1).view(torch.uint8).numpy().data
            at += t.nbytes
        LENGTH.pack_into(mm, WRITE_AT, write + body)
        self.items.release()

    def get(self, timeout: float) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """The next message (header, tensors), or None when none came within `timeout` s."""
        if not self.items.acquire(timeout=timeout):
            return None
        mm = self._map
        _, read = self._positions()
        offset = read % self.capacity
        if self.capacity - offset < LENGTH.size or LENGTH.unpack_from(mm, HEADER + offset)[0] == WRAP:
            read += self.capacity - offset
            offset = 0
        at = HEADER + offset
        size = LENGTH.unpack_from(mm, at)[0]
        head_len = LENGTH.unpack_from(mm, at + LENGTH.size)[0]
        data = bytearray(mm[at + 2 * LENGTH.size : at + LENGTH.size + size])
        LENGTH.pack_into(mm, READ_AT, read + LENGTH.size + size)
        header, specs = pickle.loads(data[:head_len])
        tensors, cursor = {}, head_len
        view = memoryview(data)
        for spec in specs:
            raw = view[cursor : cursor + spec.nbytes]
            dtype = DTYPES[spec.dtype]
            if spec.nbytes:
                tensors[spec.name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(spec.shape)
            else:
                tensors[spec.name] = torch.empty(spec.shape, dtype=dtype)
            cursor += spec.nbytes
        return header, tensors

    def unlink(self) -> None:
        """Remove the segment's name (both sides keep their mappings)."""
        if os.getpid() == self._owner:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment."""
        if self._mm is not None:
            close_map(self._mm)
            self._mm = None
        if os.getpid() == self._owner:
            self.path.unlink(missing_ok=True)
