"""Joins the segment files of one profile into one Chrome trace, in a process of its own.

    python -I -S omni_common/runtime/trace_merge.py SEGMENTS   (the standard library only)
    (then OUT, a line on stdin)

StageProfiler (profiler.py) ends its recording in short segments, each saved as torch's
Chrome trace JSON under SEGMENTS (000001.json, ...). This process streams them, in name
order, into OUT: the first segment's header, every segment's events (the process and thread
names once), timestamps moved onto the first segment's base time. It runs outside the
replica because parsing and writing hundreds of MB would hold the replica's GIL: a separate
process holds none (and runs at a lower priority). OUT is made fresh (O_EXCL | O_NOFOLLOW,
0600); each segment is deleted once copied, so the disk holds at most one segment twice.

The replica starts this process with a profile and pauses it (SIGSTOP) while it computes
(profiler.IdleMerges). So it first asks the kernel for SIGCONT when the replica dies (a
paused process would otherwise be left behind, stopped), then writes `ready` and waits for
OUT, sent when the profile stops: a replica that died before can no longer pause it, and
end of input (a dropped profile, or a replica gone) means nothing to merge.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

FRESH = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def segment_files(segments: Path) -> list[Path]:
    return sorted(path for path in segments.iterdir() if path.suffix == ".json")


def merge(segments: Path, out: Path) -> int:
    """Write OUT from the segments under SEGMENTS; the number of events written. The events
    go to a hidden file beside OUT, linked to OUT once whole: a trace found there is complete
    (a rank's appears after its replica's StopProfile answered), and a name already taken
    is never replaced."""
    partial = out.with_name(f".{out.name}.partial")
    fd = os.open(partial, FRESH, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        written = _stream_events(segments, out, os.fdopen(fd, "w"))
        os.link(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return written


def _stream_events(segments: Path, out: Path, sink: IO[str]) -> int:
    with sink:
        written, base = 0, None
        named: set[str] = set()
        for path in segment_files(segments):
            with open(path, "rb") as source:
                document = json.load(source)
            events = document.pop("traceEvents", [])
            document.pop("traceName", None)
            if base is None:
                base = int(document.get("baseTimeNanoseconds", 0))
                _header(sink, document)
            shift_us = (int(document.get("baseTimeNanoseconds", base)) - base) / 1000
            for event in _once(events, named):
                if shift_us and isinstance(event.get("ts"), (int, float)):
                    event["ts"] += shift_us
                sink.write(("\n" if written == 0 else ",\n") + json.dumps(event))
                written += 1
            path.unlink()
        if base is None:
            _header(sink, {"schemaVersion": 1, "displayTimeUnit": "ms"})
        sink.write(f"\n],\n{json.dumps('traceName')}: {json.dumps(str(out))}\n}}\n")
    return written


def _header(sink: IO[str], document: dict[str, Any]) -> None:
    sink.write("{\n")
    for key, value in document.items():
        sink.write(f"{json.dumps(key)}: {json.dumps(value)},\n")
    sink.write('"traceEvents": [')


def _once(events: list[dict[str, Any]], named: set[str]) -> Iterator[dict[str, Any]]:
    """The events, less a process or thread name (metadata, "ph": "M") already written:
    every segment repeats them."""
    for event in events:
        if event.get("ph") == "M":
            key = json.dumps([event.get("name"), event.get("pid"), event.get("tid"), event.get("args")])
            if key in named:
                continue
            named.add(key)
        yield event


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -I -S trace_merge.py SEGMENTS, then OUT on stdin", file=sys.stderr)
        return 2
    continue_when_parent_dies()
    print("ready", flush=True)
    out = sys.stdin.readline().rstrip("\n")
    if not out:
        print("no trace to write: the profile was dropped", file=sys.stderr)
        return 1
    os.nice(10)  # the replica's compute comes first (when the merge runs beside it at all)
    merge(Path(argv[0]), Path(out))
    return 0


def continue_when_parent_dies() -> None:
    """SIGCONT from the kernel when the process (the thread) that started this one ends
    (Linux; elsewhere a replica that dies while it is paused leaves it stopped)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGCONT) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
