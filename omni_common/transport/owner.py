"""Who made a shared-memory segment, written into the segment itself.

A stamp is the creating process's pid, pid namespace and start time. A later process reads
it to tell whether the creator is gone, so that what a killed process left can be swept
(`sweep_stale_segments`). A pid alone is not enough: pids are reused, and a pid from another
namespace means nothing here.
"""

from __future__ import annotations

import os
import struct

# magic (what kind of segment), owner pid, owner pid-namespace inode, owner start time (ticks)
STAMP = struct.Struct("<8sQQQ")


def _proc_stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name ([] when unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return []


def start_time(pid: int) -> int:
    """Start time of a process in clock ticks (0 when unknown); tells a reused pid apart."""
    fields = _proc_stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def _is_zombie(pid: int) -> bool:
    """Whether `pid` has exited but not been reaped yet (its memory, segments aside, is gone)."""
    fields = _proc_stat(pid)
    return bool(fields) and fields[0] == b"Z"


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def this_process() -> tuple[int, int, int]:
    """(pid, pid namespace, start time) of the calling process."""
    pid = os.getpid()
    return pid, pid_namespace(), start_time(pid)


def is_gone(pid: int, pid_ns: int, start: int) -> bool:
    """Whether the process a stamp names has exited. False when that cannot be known (another
    pid namespace, a pid we may not signal): a segment is swept only when its owner is surely
    gone."""
    if pid <= 0 or pid_ns != pid_namespace():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    if _is_zombie(pid):
        return True  # killed, its parent has not waited for it yet
    return bool(start) and start_time(pid) not in (0, start)  # pid reused by someone else


def stamp(magic: bytes) -> bytes:
    """The stamp of the calling process, for a segment of kind `magic` (8 bytes)."""
    return STAMP.pack(magic, *this_process())


def stamped_owner_is_gone(header: bytes, magic: bytes) -> bool:
    """Whether `header` starts with a stamp of kind `magic` whose process has exited."""
    if len(header) < STAMP.size:
        return False
    kind, pid, pid_ns, start = STAMP.unpack_from(header, 0)
    return kind == magic and is_gone(pid, pid_ns, start)
