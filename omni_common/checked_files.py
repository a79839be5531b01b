"""Files a call names (LoRA adapters, pushed weights), opened so that no call can hang or
exhaust the process.

What went wrong before: a directory holding a FIFO named `*.safetensors` passed a check made
on the directory's path, and safetensors then blocked in `open` holding the GIL, which froze
every thread of the replica (health, heartbeats, even SIGTERM). So, here:
- a path resolves inside a configured root when there is one (symlinks resolved first, so
  none escapes it), and what lies outside reads exactly as what does not exist;
- every file is checked as it is opened, not by its name: `O_NONBLOCK` (opening a FIFO or a
  device never waits) and `O_NOFOLLOW`, then `fstat` on the descriptor: a regular file only;
- a safetensors header is read and checked (its length, every tensor's dtype, shape and
  offsets, and the caller's limits) before any tensor byte is read; tensors are then read
  with `pread` (which releases the GIL) into memory of the declared size, never mapped;
- reads run on a small bounded pool of threads (`FileReader`), never on the event loop or a
  stage's compute thread, and a burst beyond its queue is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import stat
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from omni_common.errors import InvalidArgument, NotFound, ResourceExhausted

T = TypeVar("T")

# safetensors' own bound is 100 MB; a real model's header (thousands of tensors) is < 1 MiB.
MAX_HEADER_BYTES = 16 << 20
MAX_PATH_CHARS = 4096

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header declares it: offsets are into the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked header: every entry lies inside the file and has the size its shape says."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int  # file offset of the data section
    data_bytes: int  # the tensors' bytes: what reading them takes


def shown(text: str) -> str:
    """A path as an error may show it: short, and only what the caller sent."""
    return repr(text[:200])


def checked_text(text: str, what: str) -> str:
    """INVALID_ARGUMENT for a path no file system takes (empty, a NUL byte, too long)."""
    if not text or "\0" in text or len(text) > MAX_PATH_CHARS:
        raise InvalidArgument(f"{shown(text.replace(chr(0), '?'))} is no usable path for a {what}")
    return text


def confined(text: str | Path, root: Path | None, what: str) -> Path:
    """The path a call names, resolved; inside `root` when there is one. Symlinks are resolved
    before the check, so none leads out of the root; a path outside it is NOT_FOUND, worded as
    one that does not exist, so errors tell nothing about the rest of the machine."""
    text = checked_text(str(text), what)
    base = root.resolve() if root is not None else Path.cwd()
    try:
        # Resolved here, so the open (O_NOFOLLOW) meets no symlink a call may use; an
        # absolute path replaces `base`.
        resolved = (base / text).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise NotFound(f"no {what} at {shown(text)}") from None
    if root is not None and resolved != base and base not in resolved.parents:
        raise NotFound(f"no {what} at {shown(text)}")
    return resolved


@contextmanager
def open_regular(path: Path, what: str) -> Iterator[tuple[int, int]]:
    """(descriptor, size) of a regular file, checked as opened: a FIFO, device or socket never
    blocks the open (O_NONBLOCK) and is refused by fstat; a symlink as the last component is
    refused (O_NOFOLLOW: `confined` already resolved the ones a call may use)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise NotFound(f"no {what} at {shown(str(path))}") from None
    except OSError:
        raise InvalidArgument(f"{shown(str(path))} is not a readable regular file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"{shown(str(path))} is not a regular file")
        yield fd, info.st_size
    finally:
        os.close(fd)


def is_directory(path: Path) -> bool:
    """Whether `path` is a directory (lstat: a symlink is not one; `confined` resolved those)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise InvalidArgument("the file ended before its header said it would")
        done += got


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    buffer = bytearray(size)
    _pread_into(fd, memoryview(buffer), offset)
    return bytes(buffer)


def read_header(fd: int, size: int, name: str) -> SafetensorsHeader:
    """The file's safetensors header, checked against the file's real size."""
    bad = f"{name!r} is not a valid safetensors file"
    if size < 8:
        raise InvalidArgument(bad)
    (length,) = struct.unpack("<Q", bytes(_pread_exact(fd, 8, 0)))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise InvalidArgument(f"{bad}: its header length is out of range")
    try:
        raw = json.loads(_pread_exact(fd, length, 8))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidArgument(f"{bad}: its header is not JSON") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(bad)
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidArgument(f"{bad}: its __metadata__ is not a map of strings")
    data_bytes = size - 8 - length
    tensors = {key: _entry(key, value, data_bytes, bad) for key, value in raw.items()}
    # As safetensors requires: the tensors tile the data from 0 without holes or overlaps,
    # so the bytes read are exactly the tensors' sizes, which the caller's limits bound.
    end = 0
    for entry in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != end:
            raise InvalidArgument(f"{bad}: its tensors overlap or leave holes")
        end = entry.end
    return SafetensorsHeader(tensors, metadata, 8 + length, end)


def _entry(key: str, value: object, data_bytes: int, bad: str) -> TensorEntry:
    try:
        assert isinstance(value, dict)
        dtype = DTYPES[value["dtype"]]
        shape = tuple(value["shape"])
        begin, end = value["data_offsets"]
        assert all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
    except (AssertionError, KeyError, TypeError, ValueError):
        raise InvalidArgument(f"{bad}: tensor {key[:120]!r} is malformed or of an unknown dtype") from None
    entry = TensorEntry(dtype, shape, begin, end)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not begin <= end <= data_bytes or end - begin != entry.numel * itemsize:
        raise InvalidArgument(f"{bad}: tensor {key[:120]!r} does not lie where its header says")
    return entry


def read_tensors(fd: int, header: SafetensorsHeader) -> dict[str, torch.Tensor]:
    """Every tensor of a checked header, read with pread (the GIL released) into one fresh
    buffer laid out as the file (its header's bytes left unread), each a view at its file
    offset. That is the layout (and the alignment) that safetensors' own loader gives, which
    diffusers reads adapters with: CPU kernels may round differently on memory aligned
    otherwise, and an adapter's image is bitwise diffusers' (tests/unit/models/qwenimage/test_lora.py)."""
    start = header.data_start
    buffer = torch.empty(start + header.data_bytes, dtype=torch.uint8)
    _pread_into(fd, buffer.numpy().data[start:], start)
    return {
        key: buffer[start + entry.begin : start + entry.end].view(entry.dtype).reshape(entry.shape)
        for key, entry in header.tensors.items()
    }


HeaderCheck = Callable[[SafetensorsHeader], None]


def read_safetensors_file(
    path: Path, what: str, check: HeaderCheck | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, opened checked; `check` sees the header
    first and refuses it (raising an OmniError) before any tensor is read."""
    with open_regular(path, what) as (fd, size):
        header = read_header(fd, size, path.name)
        if check is not None:
            check(header)
        return read_tensors(fd, header), header.metadata


class FileReader:
    """A small pool of threads for file reads, with a bounded queue: a burst of calls that
    name files waits on at most `max_pending` reads, and the next is RESOURCE_EXHAUSTED."""

    def __init__(self, threads: int = 2, max_pending: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="file-reader")
        self.max_pending = max_pending
        self.pending = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self.pending >= self.max_pending:
            raise ResourceExhausted(
                f"{self.pending} file reads are queued on this replica; retry later", retry_after_ms=1000
            )
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
