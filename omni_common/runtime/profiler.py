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
- the recording is processed and written in a child process, never in the replica: torch
  holds the GIL while it processes a recording's events (`_disable_profiler`, its C++
  post-processing) and while it writes the JSON, for a time proportional to the events
  (benchmarks/profile_stop.py: ~5-13 s and ~4 s per 100k operator events on 2 shared CPU
  cores), and every thread of the process would wait. So stopping forks the compute thread:
  the child processes the recording, writes the trace and exits; the parent leaves the
  recording unprocessed and ends the compute thread (compute_thread.py: a fresh one takes its
  queue), whose thread-local state, where torch keeps the recording, goes with it. The
  replica's threads then wait only for the fork (page tables: ~ms per GiB of memory). With
  CUDA the child cannot flush the GPU's activity buffers (CUDA is unusable in a forked
  child), so on a GPU, and where no renewable compute thread is given, the recording is
  processed in the replica as before: there the memory bound is also the bound on that stall;
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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omni_common.errors import FailedPrecondition, InvalidArgument, OmniError

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
        renew_thread: Callable[[], None] | None = None,
    ) -> None:
        self.stage = stage
        self.device = device
        # ComputeThread.renew of the compute thread: with it (and no CUDA), stopping hands the
        # recording to a forked child and drops it here with the thread (see the docstring).
        self.renew_thread = renew_thread
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
        trace = self._directory / f"{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}-{id(prof):x}.json"
        if self.renew_thread is not None and self.device.type != "cuda":
            pid = _fork_writer(trace)  # the child processes and writes the recording
            self.renew_thread()  # and this thread, holding the recording, ends after this task
            return self._writer.submit(_reap, pid, trace), time.monotonic() - self._started
        prof.stop()
        seconds = time.monotonic() - self._started
        return self._writer.submit(_write, prof, trace), seconds

    def close(self) -> None:
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
        self._writer.shutdown(wait=True)


def _fork_writer(trace: Path) -> int:
    """A child process that processes this thread's recording and writes it to `trace`, then
    exits (1 on any failure; it touches nothing else: no logging, no locks other threads may
    have held at the fork)."""
    pid = os.fork()
    if pid == 0:  # the child: this thread alone, the recording in its thread-locals
        code = 1
        try:
            fd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.close(fd)
            torch.autograd._disable_profiler().save(str(trace))
            code = 0
        finally:
            os._exit(code)
    return pid


def _reap(pid: int, trace: Path) -> Path:
    """The forked writer's trace once it exited (the writer thread waits, without the GIL)."""
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OmniError("the profile's trace could not be written (its writer process failed)")
    _owner_only_file(trace)
    return trace


def _owner_only_file(trace: Path) -> None:
    fd = os.open(trace, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _write(prof: profile, trace: Path) -> Path:
    """The trace's file, made fresh (O_EXCL | O_NOFOLLOW) before torch writes it: nothing
    planted at that name is followed or overwritten. torch replaces the file under the
    process's umask, so it is made 0600 again after (inside a 0700 directory meanwhile)."""
    fd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    prof.export_chrome_trace(str(trace))
    _owner_only_file(trace)
    return trace
