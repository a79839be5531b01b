"""A torch.profiler trace of a stage replica (StageControl.StartProfile / StopProfile).

Traces go under the replica's profile directory (--profile-dir, by default
omnistage-profiles-<uid> in the system's temporary directory), each call's in a subdirectory
it names or a new one: a call never chooses where on the machine a file is written. The
profiler records on the replica's compute thread, where every forward runs: CPU operators
with their input shapes (and CUDA kernels on a GPU); the trace is one Chrome trace JSON
file, which chrome://tracing and Perfetto (ui.perfetto.dev) open.

What keeps a profile from hurting serving (issue 38):
- torch processes a recording's events when it stops, holding the GIL (every thread of the
  process waits: ~1.8 s per 20k operator events with shapes on 2 shared CPU cores), and it
  keeps the recording in the state of the thread that started it. So the compute thread
  records in segments: after each task (CPU; on CUDA after the first task that ends a second
  after the segment began, since each end synchronizes the device) it ends the segment and
  saves it (the cost lands on the task whose events they are, as profiling overhead) and
  records the next. StopProfile ends only the last segment; a process of its own
  (trace_merge.py, exec'd, never a fork of this one) joins the segments into the trace;
- that process runs only while the compute thread runs no task (IdleMerges: paused with
  SIGSTOP from `before_task` to the end of `after_task`): on 2 shared vCPUs any process
  running beside a request slowed it 1.4-2.1x, whatever its priority
  (benchmarks/profile_stop.py). A merge runs beside the tasks too once it has waited
  `merge_patience_s`, so StopProfile, which replies once the trace is written, returns in
  bounded time from a replica that is never idle. Should the replica die while a merge is
  paused, the kernel continues it (trace_merge.py asks for SIGCONT at its parent's death);
- a session stops itself after `max_seconds`, or once its saved segments or the process's
  growth in resident memory since it started pass `max_bytes` (a client that never sends
  StopProfile, a Ctrl-C, a crash): the compute thread checks after each of its tasks;
- a session still running when the replica closes is dropped on the compute thread, before
  that thread ends (a recording left in an ended thread's state crashes the process at
  exit);
- the profile directory is owner-only (0700, owned by this user: a shared /tmp directory
  made by someone else is refused), subdirectories and trace files are created fresh
  (mode 0700 / 0600) and a symlink planted anywhere on the way is refused, never followed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from omni_common.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("omnistage.profiler")
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
MAX_SECONDS = 60.0
MAX_BYTES = 1 << 30
# On CUDA a segment's end synchronizes the device: one a second at most (CPU: every task).
SEGMENT_S_CUDA = 1.0
MERGE_TIMEOUT_S = 1800.0
# A merge paused while tasks run (IdleMerges) runs beside them after this long.
MERGE_PATIENCE_S = 3.0
MERGE_SCRIPT = Path(__file__).with_name("trace_merge.py")


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


@dataclass
class ProfileSession:
    """One profile: its directory, the segments saved so far, the segment recording now."""

    directory: Path
    segments: Path  # a fresh 0700 subdirectory of `directory`, removed once merged
    started: float
    rss_at_start: int
    recording: profile
    segment_started: float
    merge: subprocess.Popen[str]  # trace_merge.py, started with the session, waiting for the stop
    count: int = 0  # segments saved
    saved_bytes: int = 0


class IdleMerges:
    """The processes (trace_merge.py) that join sessions' segments into their traces, each
    paused (SIGSTOP) while the compute thread runs a task and continued (SIGCONT) once it runs
    none, until it has waited `patience_s`. `spawn`, `submit`, `cancel`, `task_starts` and
    `task_ends` come from the compute thread, a thread of its own waits for each merge.

    A process is started with its session, so that Python's start-up (~50 ms of CPU) is
    done long before the stop. It says `ready` once the kernel would continue it should this
    process die, then waits for the trace's path on stdin: it is paused from then on whenever
    a task runs, and at the stop before it reads that path if a task runs then."""

    def __init__(self, stage: str, patience_s: float) -> None:
        self.stage = stage
        self.patience_s = patience_s
        self._lock = threading.Lock()
        self._held: dict[subprocess.Popen[str], float] = {}  # a merge -> when it became pausable
        self._busy = False  # a task is running on the compute thread
        self._closing = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{stage}-profile-merge")

    def spawn(self, segments: Path) -> subprocess.Popen[str]:
        """The process that will join the segments under `segments` (no fork of this one: it
        only execs; -I -S: the script needs the standard library alone, from wherever this
        package was loaded)."""
        argv = [sys.executable, "-I", "-S", str(MERGE_SCRIPT), str(segments)]
        pipe = subprocess.PIPE
        return subprocess.Popen(argv, stdin=pipe, stdout=pipe, stderr=pipe, text=True)

    def submit(self, process: subprocess.Popen[str], segments: Path, trace: Path) -> Future[Path]:
        """`process` joins the segments into `trace`: the trace's file once written, the
        segments' directory removed."""
        return self._pool.submit(self._merge, process, segments, trace)

    @staticmethod
    def cancel(process: subprocess.Popen[str]) -> None:
        """A dropped session's process: it reads no path, so it exits without merging."""
        with process:
            process.communicate()

    def task_starts(self) -> None:
        with self._lock:
            self._busy = True
            for process, since in self._held.items():
                self._pause(process, since)

    def task_ends(self) -> None:
        with self._lock:
            self._busy = False
            for process in self._held:
                process.send_signal(signal.SIGCONT)  # a no-op once it has exited

    def _pause(self, process: subprocess.Popen[str], since: float) -> None:
        if not self._closing and time.monotonic() - since < self.patience_s:
            process.send_signal(signal.SIGSTOP)

    def _merge(self, process: subprocess.Popen[str], segments: Path, trace: Path) -> Path:
        try:
            with process:
                assert process.stdout is not None
                if process.stdout.readline() == "ready\n":
                    with self._lock:
                        self._held[process] = time.monotonic()
                        if self._busy:
                            self._pause(process, self._held[process])
                try:
                    _, error = process.communicate(f"{trace}\n", timeout=MERGE_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    _, error = process.communicate()
                finally:
                    with self._lock:
                        self._held.pop(process, None)
        finally:
            shutil.rmtree(segments, ignore_errors=True)
        if process.returncode != 0:
            trace.unlink(missing_ok=True)
            log.error("%s: merging a profile's segments failed; the profile is dropped", self.stage)
            raise RuntimeError(f"merging the profile's segments failed: {error.strip()[-500:]}")
        return trace

    def close(self) -> None:
        """Continue every paused merge and wait for them: none is left behind."""
        with self._lock:
            self._closing = True
            for process in self._held:
                process.send_signal(signal.SIGCONT)
        self._pool.shutdown(wait=True)


class StageProfiler:
    """At most one trace at a time; `start`, `stop`, `before_task`, `after_task` and `close`
    run on the compute thread (torch keeps a recording in the state of the thread that
    started it), the segments are joined into the trace by a process of its own that runs
    while that thread is idle."""

    def __init__(
        self,
        stage: str,
        device: torch.device,
        root: str = "",
        *,
        max_seconds: float = MAX_SECONDS,
        max_bytes: int = MAX_BYTES,
        segment_s: float | None = None,
        merge_patience_s: float = MERGE_PATIENCE_S,
    ) -> None:
        self.stage = stage
        self.device = device
        self.root = Path(root) if root else default_root()
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        if segment_s is None:
            segment_s = SEGMENT_S_CUDA if device.type == "cuda" else 0.0
        self.segment_s = segment_s
        self._session: ProfileSession | None = None
        self._merges = IdleMerges(stage, merge_patience_s)
        # A session that stopped itself: its trace's file (being merged) and seconds recorded,
        # until StopProfile collects them.
        self._stopped: tuple[Future[Path], float] | None = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self, name: str) -> Path:
        """Start recording; the trace will go to the subdirectory `name` of the profile
        directory (a new one when empty)."""
        if self._session is not None:
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
        segments = Path(tempfile.mkdtemp(prefix=".segments-", dir=path))  # 0700, fresh
        rss_at_start = resident_bytes()  # the recording's own memory counts as growth
        try:
            merge = self._merges.spawn(segments)
        except OSError:
            shutil.rmtree(segments, ignore_errors=True)
            raise
        try:
            recording = self._record()
        except Exception:
            self._merges.cancel(merge)
            shutil.rmtree(segments, ignore_errors=True)
            raise
        self._stopped = None  # an uncollected self-stopped trace stays on disk
        now = time.monotonic()
        self._session = ProfileSession(path, segments, now, rss_at_start, recording, now, merge)
        return path

    def _record(self) -> profile:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        recording = profile(activities=activities, record_shapes=True)
        recording.start()
        return recording

    def before_task(self) -> None:
        """A task of the compute thread starts: merges pause."""
        self._merges.task_starts()

    def after_task(self) -> None:
        """After a task of the compute thread: stop a session past its time or size bound,
        else end a segment `segment_s` old and record the next, then let merges run. A
        failure here drops the profile, never the task's own result."""
        try:
            self._segment_after_task()
        finally:
            self._merges.task_ends()

    def _segment_after_task(self) -> None:
        session = self._session
        if session is None:
            return
        try:
            due = time.monotonic() - session.segment_started >= self.segment_s
            if not self._stopped_itself(session) and due:
                self._save_segment(session)
                session.recording, session.segment_started = self._record(), time.monotonic()
        except Exception:
            log.exception("%s: ending a profile segment failed; the profile is dropped", self.stage)
            self._session = None
            _drop(session)

    def _stopped_itself(self, session: ProfileSession) -> bool:
        seconds = time.monotonic() - session.started
        grown = max(resident_bytes() - session.rss_at_start, session.saved_bytes)
        if seconds <= self.max_seconds and grown <= self.max_bytes:
            return False
        log.warning(
            "%s: the profile stopped itself after %.1f s, %.0f MiB recorded or grown "
            "(bounds: %.0f s, %.0f MiB); StopProfile returns its trace",
            self.stage,
            seconds,
            grown / 2**20,
            self.max_seconds,
            self.max_bytes / 2**20,
        )
        self._stopped = self._finish()
        return True

    def stop(self) -> tuple[Future[Path], float]:
        """End the recording (the compute thread): (its file, being merged; seconds
        recorded). A session that stopped itself is collected here."""
        if self._session is None:
            if self._stopped is None:
                raise FailedPrecondition(f"no profile of this {self.stage} is running")
            stopped, self._stopped = self._stopped, None
            return stopped
        return self._finish()

    def _save_segment(self, session: ProfileSession) -> None:
        """End the segment recording now and save it: torch processes its events holding
        the GIL, so a segment is kept short (one task on CPU) and StopProfile, which ends only
        the last one, never stalls the replica for the whole session."""
        session.recording.stop()
        session.count += 1
        segment = session.segments / f"{session.count:06d}.json"
        _write(session.recording, segment)
        session.saved_bytes += segment.stat().st_size

    def _finish(self) -> tuple[Future[Path], float]:
        session, self._session = self._session, None
        assert session is not None
        try:
            self._save_segment(session)
        except Exception:
            _drop(session)
            raise
        seconds = time.monotonic() - session.started
        trace = session.directory / f"{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}-{id(session):x}.json"
        return self._merges.submit(session.merge, session.segments, trace), seconds

    def close(self) -> None:
        """Drop a running session (the compute thread, before it ends: a recording left in
        an ended thread's state crashes the process at exit) and wait for merges, paused
        ones continued."""
        session, self._session = self._session, None
        if session is not None:
            _drop(session)
        self._merges.close()


def _drop(session: ProfileSession) -> None:
    """End a session's recording (if still running), its merge process and its segments."""
    with contextlib.suppress(Exception):  # already stopped: torch warns or raises
        session.recording.stop()
    IdleMerges.cancel(session.merge)
    shutil.rmtree(session.segments, ignore_errors=True)


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
