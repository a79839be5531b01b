"""A torch.profiler trace of a stage replica (StageControl.StartProfile / StopProfile).

Traces go under the replica's profile directory (--profile-dir, by default
omnistage-profiles-<uid> in the system's temporary directory), each call's in a subdirectory
it names or a new one: a call never chooses where on the machine a file is written. The
profiler starts and stops on the replica's compute thread, where every forward runs, and
records CPU operators (and CUDA kernels on a GPU); the trace is written as Chrome trace JSON,
which chrome://tracing and Perfetto (ui.perfetto.dev) open.

What keeps a profile from hurting serving (issue 38):
- a session stops itself after `max_seconds` or once the process has grown `max_bytes` of
  resident memory since it started (a client that never sends StopProfile, a Ctrl-C, a
  crash): the compute thread checks after each of its tasks (`enforce_limits`);
- the trace (hundreds of MB for a few hundred requests) is written by a writer thread, never
  the compute thread: stopping only ends the recording there. What no thread choice avoids:
  torch holds the GIL while it stops (its C++ post-processing of the events) and while it
  writes the JSON, every thread of the process waits, for a time proportional to the events
  recorded (benchmarks/profile_stop.py: ~5-13 s and ~4 s per 100k operator events on 2
  shared CPU cores). The memory bound is therefore also the bound on that stall;
- the profile directory is owner-only (0700, owned by this user: a shared /tmp directory
  made by someone else is refused), subdirectories and trace files are created fresh
  (mode 0700 / 0600) and a symlink planted anywhere on the way is refused, never followed.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omni_common.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("omnistage.profiler")
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
MAX_SECONDS = 60.0
MAX_BYTES = 1 << 30


def default_root() -> Path:
    """Per user, so two users of a host never share (or race for) one directory."""
    return Path(tempfile.gettempdir()) / f"omnistage-profiles-{os.getuid()}"


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere: the time bound still holds)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def owner_only_directory(path: Path, *, create: bool) -> Path:
    """`path` as a directory that only this user can use: made 0700 when absent (with
    `create`), else it must be a real directory (not a symlink) owned by this user, and is
    then set to 0700. FAILED_PRECONDITION otherwise: the operator fixes the directory."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as err:
            raise FailedPrecondition(f"cannot make the profile directory ({err.strerror})") from None
    try:
        info = os.lstat(path)
    except OSError:
        raise FailedPrecondition("the profile directory does not exist") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise FailedPrecondition(f"{path.name!r} in the profile directory is a symlink or no directory")
    if info.st_uid != os.getuid():
        raise FailedPrecondition(f"profile directory {path.name!r} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class StageProfiler:
    """At most one trace at a time; `start`, `stop` and `enforce_limits` run on the compute
    thread, the trace's file is written on a writer thread."""

    def __init__(
        self,
        stage: str,
        device: torch.device,
        root: str = "",
        *,
        max_seconds: float = MAX_SECONDS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.stage = stage
        self.device = device
        self.root = Path(root) if root else default_root()
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        self._profile: profile | None = None
        self._directory: Path | None = None
        self._started = 0.0
        self._rss_at_start = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{stage}-profile-writer")
        # A session that stopped itself: its trace's file (being written) and seconds recorded,
        # until StopProfile collects them.
        self._stopped: tuple[Future[Path], float] | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, name: str) -> Path:
        """Start recording; the trace will go to the subdirectory `name` of the profile
        directory (a new one when empty)."""
        if self._profile is not None:
            raise FailedPrecondition(f"a profile of this {self.stage} is already running; stop it first")
        if name and not NAME.fullmatch(name):
            raise InvalidArgument(
                "a profile name is 1-64 letters, digits, '.', '_' or '-', not starting with '.'"
            )
        self.root.parent.mkdir(parents=True, exist_ok=True)
        owner_only_directory(self.root, create=True)
        if name:
            path = owner_only_directory(self.root / name, create=True)
        else:
            path = Path(tempfile.mkdtemp(prefix=f"{self.stage}-", dir=self.root))  # 0700, fresh
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._stopped = None  # an uncollected self-stopped trace stays on disk
        self._profile = profile(activities=activities, record_shapes=True)
        self._profile.start()
        self._directory, self._started = path, time.monotonic()
        self._rss_at_start = resident_bytes()
        return path

    def enforce_limits(self) -> None:
        """Stop a session past its time or memory bound (the compute thread, between tasks)."""
        if self._profile is None:
            return
        seconds = time.monotonic() - self._started
        grown = resident_bytes() - self._rss_at_start
        if seconds > self.max_seconds or grown > self.max_bytes:
            log.warning(
                "%s: the profile stopped itself after %.1f s, the process %.0f MiB larger "
                "(bounds: %.0f s, %.0f MiB); StopProfile returns its trace",
                self.stage,
                seconds,
                grown / 2**20,
                self.max_seconds,
                self.max_bytes / 2**20,
            )
            self._stopped = self._finish()

    def stop(self) -> tuple[Future[Path], float]:
        """End the recording (the compute thread): (its file, being written by the writer
        thread; seconds recorded). A session that stopped itself is collected here."""
        if self._profile is None:
            if self._stopped is None:
                raise FailedPrecondition(f"no profile of this {self.stage} is running")
            stopped, self._stopped = self._stopped, None
            return stopped
        return self._finish()

    def _finish(self) -> tuple[Future[Path], float]:
        assert self._profile is not None and self._directory is not None
        prof, self._profile = self._profile, None
        prof.stop()
        seconds = time.monotonic() - self._started
        trace = self._directory / f"{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}-{id(prof):x}.json"
        return self._writer.submit(_write, prof, trace), seconds

    def close(self) -> None:
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
        self._writer.shutdown(wait=True)


def _write(prof: profile, trace: Path) -> Path:
    """The trace's file, made fresh (O_EXCL | O_NOFOLLOW) before torch writes it: nothing
    planted at that name is followed or overwritten. torch replaces the file under the
    process's umask, so it is made 0600 again after (inside a 0700 directory meanwhile)."""
    fd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    prof.export_chrome_trace(str(trace))
    fd = os.open(trace, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return trace
