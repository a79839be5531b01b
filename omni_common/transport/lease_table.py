"""The lease table: a shared-memory segment `omnistage-<token>-leases` with fixed slots.

Producers write slots under a seqlock (seq is odd while a slot is being written);
consumers on the same host read them to check a ShmRef or CudaIpcRef before and after
mapping it.
The header names the owner process so that a restart can sweep a dead owner's files.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from omni_common.errors import InvalidArgument, ResourceExhausted

from .arena import FILE_RE, close_map, create_segment, segment_path
from .owner import STAMP, is_gone, stamped_owner_is_gone, this_process

MAGIC = b"OMNILEAS"
VERSION = 1
# magic, version, capacity, owner pid, owner pid-namespace inode, owner start time (ticks)
HEADER = struct.Struct("<8sIIQQQ")
HEADER_BYTES = 64
# seq, nonce, segment index, pad, offset, nbytes, generation, expires_at (time.time()),
# digest. The digest fills the slot's last 8 bytes, which version 1 left zero and readers
# that predate it never read: it binds a CUDA lease to the handle it was exported with.
SLOT = struct.Struct("<QQIIQQQdQ")
SLOT_BYTES = 64
SEQ = struct.Struct("<Q")
CAPACITY = 4096
# The segment index of a lease on GPU memory (CUDA IPC) rather than in the shm arena; arena
# ids stop at nine digits, so no ShmRef can name it.
CUDA_SEGMENT = 0xFFFFFFFF

# A ShmQueue's segment (omni_common.runtime.shm_queue) starts with its owner's stamp.
QUEUE_RE = re.compile(r"omnistage-[0-9a-f]{16}-queue")
QUEUE_MAGIC = b"OMNIQUEU"

LEASE_ID_RE = re.compile(r"([0-9a-f]{16})-(0|[1-9][0-9]{0,5})-([0-9a-f]{16})")


@dataclass(frozen=True)
class LeaseSlot:
    seq: int
    nonce: int
    segment: int
    offset: int
    nbytes: int
    generation: int
    expires_at: float
    digest: int


@dataclass(frozen=True)
class LeaseKey:
    token: str
    slot: int
    nonce: int


def parse_lease_id(lease_id: str) -> LeaseKey:
    """Split a lease id; InvalidArgument when it is malformed (the id is not echoed)."""
    m = LEASE_ID_RE.fullmatch(lease_id)
    if m is None:
        raise InvalidArgument("malformed lease id")
    return LeaseKey(m.group(1), int(m.group(2)), int(m.group(3), 16))


def format_lease_id(token: str, slot: int, nonce: int) -> str:
    return f"{token}-{slot}-{nonce:016x}"


def short(lease_id: str) -> str:
    """A prefix of a lease id that is safe to log or put in an error."""
    return lease_id[:8] + "…"


def read_slot(buf: mmap.mmap, slot: int) -> LeaseSlot:
    """A consistent snapshot of one slot (seqlock read)."""
    base = HEADER_BYTES + slot * SLOT_BYTES
    while True:
        fields = SLOT.unpack_from(buf, base)
        if fields[0] % 2 == 0 and SEQ.unpack_from(buf, base)[0] == fields[0]:
            seq, nonce, seg, _, off, n, gen, exp, digest = fields
            return LeaseSlot(seq, nonce, seg, off, n, gen, exp, digest)
        time.sleep(0)


def read_seq(buf: mmap.mmap, slot: int) -> int:
    return int(SEQ.unpack_from(buf, HEADER_BYTES + slot * SLOT_BYTES)[0])


def capacity_of(buf: mmap.mmap) -> int | None:
    """The slot count of a mapped table, None if the header is not ours."""
    if len(buf) < HEADER_BYTES:
        return None
    magic, version, capacity, *_ = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or len(buf) < HEADER_BYTES + capacity * SLOT_BYTES:
        return None
    return int(capacity)


class LeaseTable:
    """The producer's side: allocates, writes and clears slots. Not locked: callers lock."""

    def __init__(self, shm_dir: Path, token: str, capacity: int = CAPACITY) -> None:
        self.token = token
        self.capacity = capacity
        self.path = segment_path(shm_dir, token, "leases")
        self.mm = create_segment(self.path, HEADER_BYTES + capacity * SLOT_BYTES)
        HEADER.pack_into(self.mm, 0, MAGIC, VERSION, capacity, *this_process())
        self._free = list(range(capacity - 1, -1, -1))
        self._seq = [0] * capacity

    def add(
        self, segment: int, offset: int, nbytes: int, generation: int, ttl_s: float, digest: int = 0
    ) -> str:
        """Write a new lease; ResourceExhausted when every slot is taken."""
        if not self._free:
            raise ResourceExhausted("too many live tensor leases; release some first")
        slot = self._free.pop()
        nonce = secrets.randbits(64) or 1
        self._write(slot, nonce, segment, offset, nbytes, generation, time.time() + ttl_s, digest)
        return format_lease_id(self.token, slot, nonce)

    def clear(self, slot: int) -> None:
        self._write(slot, 0, 0, 0, 0, 0, 0.0, 0)
        self._free.append(slot)

    def _write(
        self, slot: int, nonce: int, seg: int, off: int, n: int, gen: int, exp: float, digest: int
    ) -> None:
        base = HEADER_BYTES + slot * SLOT_BYTES
        seq = self._seq[slot] + 1
        SEQ.pack_into(self.mm, base, seq)  # odd: readers retry
        SLOT.pack_into(self.mm, base, seq, nonce, seg, 0, off, n, gen, exp, digest)
        SEQ.pack_into(self.mm, base, seq + 1)
        self._seq[slot] = seq + 1

    def close(self) -> None:
        close_map(self.mm)
        self.path.unlink(missing_ok=True)


def _owner_is_dead(header: bytes) -> bool:
    magic, version, _, pid, pid_ns, start = HEADER.unpack_from(header, 0)
    if magic != MAGIC or version != VERSION:
        return False  # not ours: leave it
    return is_gone(pid, pid_ns, start)  # pid 0: still being written


def _read_head(path: Path, size: int) -> bytes:
    """The first `size` bytes of a segment file (b"" when it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    except OSError:
        return b""


def _unlink_all(root: Path, names: list[str]) -> int:
    removed = 0
    for name in names:
        try:
            os.unlink(root / name)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def sweep_stale_segments(shm_dir: Path | str = "/dev/shm") -> int:
    """Unlink the segments of omnistage processes that are gone; returns how many files.

    Only files whose owner is surely gone are touched: an arena's segments when its lease
    table names a dead owner, a queue when its own stamp does. Live processes' files and files
    without a readable table or stamp are left alone.
    """
    root = Path(shm_dir)
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    by_token: dict[str, list[str]] = {}
    queues: list[str] = []
    for name in names:
        m = FILE_RE.fullmatch(name)
        if m:
            by_token.setdefault(m.group(1), []).append(name)
        elif QUEUE_RE.fullmatch(name):
            queues.append(name)
    removed = 0
    for token, files in by_token.items():
        table = f"omnistage-{token}-leases"
        header = _read_head(root / table, HEADER.size) if table in files else b""
        if len(header) == HEADER.size and _owner_is_dead(header):
            removed += _unlink_all(root, sorted(files, key=lambda n: n.endswith("-leases")))  # table last
    for name in queues:
        if stamped_owner_is_gone(_read_head(root / name, STAMP.size), QUEUE_MAGIC):
            removed += _unlink_all(root, [name])
    return removed
