"""The producer's shared-memory arena: segment files sliced by a first-fit free list.

Segments are files `omnistage-<token>-<index>` in the shm directory, made by this process
(O_EXCL, mode 0600, never a name from a request). The arena grows by adding a segment;
an oversized segment made for one big tensor is dropped again once it is empty.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "omnistage-"
ALIGN = 256
TOKEN_RE = re.compile(r"[0-9a-f]{16}")
ARENA_ID_RE = re.compile(r"([0-9a-f]{16})-(0|[1-9][0-9]{0,8})")
FILE_RE = re.compile(r"omnistage-([0-9a-f]{16})-(leases|0|[1-9][0-9]{0,8})")


def segment_path(shm_dir: Path, token: str, index: int | str) -> Path:
    """Path of a segment; callers pass only validated tokens and indexes."""
    return shm_dir / f"{PREFIX}{token}-{index}"


def create_segment(path: Path, size: int) -> mmap.mmap:
    """Create a new private (0600) segment file of `size` bytes and map it read-write."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def close_map(mm: mmap.mmap) -> None:
    """Close a mapping; if a view still holds it, leave it to the garbage collector."""
    with contextlib.suppress(BufferError):
        mm.close()


def _aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


@dataclass
class Segment:
    index: int
    path: Path
    mm: mmap.mmap
    size: int
    # Free extents as parallel sorted lists (offsets, sizes); coalesced on free.
    free_off: list[int] = field(default_factory=list)
    free_len: list[int] = field(default_factory=list)

    def take(self, n: int) -> int | None:
        for i, length in enumerate(self.free_len):
            if length >= n:
                off = self.free_off[i]
                if length == n:
                    del self.free_off[i], self.free_len[i]
                else:
                    self.free_off[i] += n
                    self.free_len[i] -= n
                return off
        return None

    def give(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.free_off, off)
        if i < len(self.free_off) and self.free_off[i] == off + n:  # merge with the next
            n += self.free_len[i]
            del self.free_off[i], self.free_len[i]
        if i > 0 and self.free_off[i - 1] + self.free_len[i - 1] == off:  # merge with previous
            self.free_len[i - 1] += n
        else:
            self.free_off.insert(i, off)
            self.free_len.insert(i, n)

    def empty(self) -> bool:
        return self.free_len == [self.size]


class ShmArena:
    """Thread-safe allocator over this process's segments."""

    def __init__(self, shm_dir: Path, token: str, segment_bytes: int) -> None:
        self.shm_dir = shm_dir
        self.token = token
        self.segment_bytes = _aligned(segment_bytes)
        self.segments: dict[int, Segment] = {}
        self._next_index = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """Reserve `nbytes` (rounded up to 256); returns (segment index, offset)."""
        n = _aligned(nbytes)
        with self._lock:
            for seg in self.segments.values():
                off = seg.take(n)
                if off is not None:
                    return seg.index, off
            seg = self._add_segment(max(self.segment_bytes, n))
            off = seg.take(n)
            assert off is not None
            return seg.index, off

    def free(self, index: int, offset: int, nbytes: int) -> None:
        """Return a region; drops an oversized segment once it is empty."""
        with self._lock:
            seg = self.segments.get(index)
            if seg is None:
                return
            seg.give(offset, _aligned(nbytes))
            if seg.empty() and seg.size > self.segment_bytes:
                del self.segments[index]
                close_map(seg.mm)
                seg.path.unlink(missing_ok=True)

    def view(self, index: int) -> mmap.mmap:
        return self.segments[index].mm

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent)."""
        with self._lock:
            for seg in self.segments.values():
                close_map(seg.mm)
                seg.path.unlink(missing_ok=True)
            self.segments.clear()

    def _add_segment(self, size: int) -> Segment:
        index = self._next_index
        self._next_index += 1
        path = segment_path(self.shm_dir, self.token, index)
        seg = Segment(index, path, create_segment(path, size), size)
        seg.free_off.append(0)
        seg.free_len.append(size)
        self.segments[index] = seg
        return seg
