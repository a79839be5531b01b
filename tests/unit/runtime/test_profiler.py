"""StageProfiler records in segments, one per task of the compute thread on CPU, so that
StopProfile ends only the last one (issue 38: requests keep their latency while a profile
stops; benchmarks/profile_stop.py measures it). The segments join into one Chrome trace in a
process of its own, and a process that profiled exits cleanly."""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from omni_common.runtime.profiler import StageProfiler
from omni_common.runtime.trace_merge import merge

REPO = Path(__file__).resolve().parents[3]
T = TypeVar("T")


class ComputeThread:
    """One thread runs every task between the profiler's before_task and after_task, as
    Worker does."""

    def __init__(self, profiler: StageProfiler) -> None:
        self.profiler = profiler
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="compute")

    def run(self, fn: Callable[..., T], *args: object) -> T:
        return self.pool.submit(self._bounded, fn, args).result()

    def _bounded(self, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        self.profiler.before_task()
        try:
            return fn(*args)
        finally:
            self.profiler.after_task()


@pytest.fixture
def compute(tmp_path: Path) -> Iterator[ComputeThread]:
    thread = ComputeThread(StageProfiler("dit-denoise", torch.device("cpu"), str(tmp_path / "root")))
    yield thread
    thread.pool.submit(thread.profiler.close).result()
    thread.pool.shutdown()


def multiplies(count: int) -> None:
    x = torch.ones(8)
    for _ in range(count):
        x = torch.mul(x, 1.0)


def events(trace: Path) -> list[dict[str, Any]]:
    return list(json.loads(trace.read_text())["traceEvents"])


def test_every_task_of_a_session_is_in_its_one_trace(compute: ComputeThread) -> None:
    directory = compute.run(compute.profiler.start, "run")
    for count in (3, 5, 7):
        compute.run(multiplies, count)
    written, seconds = compute.run(compute.profiler.stop)
    trace = written.result()
    assert seconds > 0 and not compute.profiler.running
    recorded = events(trace)
    assert sum(event.get("name") == "aten::mul" for event in recorded) == 15
    names = [(e["name"], e["pid"], e["tid"]) for e in recorded if e.get("ph") == "M"]
    assert len(names) == len(set(names))  # each process and thread named once
    assert os.listdir(directory) == [trace.name]  # the segments are gone
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600


def test_a_session_stops_itself_at_its_size_bound(tmp_path: Path) -> None:
    profiler = StageProfiler("vae-decode", torch.device("cpu"), str(tmp_path), max_bytes=1)
    compute = ComputeThread(profiler)
    try:
        compute.pool.submit(profiler.start, "").result()
        compute.run(multiplies, 2)  # then 1 byte is passed: the session ends with this task
        assert not profiler.running
        written, _ = compute.run(profiler.stop)  # StopProfile collects the stopped session
        assert sum(event.get("name") == "aten::mul" for event in events(written.result())) == 2
    finally:
        compute.pool.submit(profiler.close).result()
        compute.pool.shutdown()


def test_a_segment_that_cannot_be_saved_drops_the_profile_not_the_task(compute: ComputeThread) -> None:
    directory = compute.run(compute.profiler.start, "gone")
    [segments] = directory.iterdir()
    shutil.rmtree(segments)  # say, a cleaner emptied the directory under the replica
    assert compute.run(lambda: torch.ones(2).add(1).tolist()) == [2.0, 2.0]
    assert not compute.profiler.running


def segment(path: Path, base_ns: int, events: list[dict[str, Any]]) -> None:
    document = {"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": events}
    path.write_text(json.dumps(document))


def test_merged_segments_share_the_first_base_time_and_name_a_thread_once(tmp_path: Path) -> None:
    segments = tmp_path / "segments"
    segments.mkdir()
    name = {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "ts": 0, "args": {"name": "c"}}
    segment(segments / "000001.json", 5_000_000, [name, {"ph": "X", "name": "a", "ts": 10.0, "dur": 1}])
    segment(segments / "000002.json", 7_000_000, [name, {"ph": "X", "name": "b", "ts": 1.0, "dur": 1}])
    assert merge(segments, tmp_path / "trace.json") == 3
    document = json.loads((tmp_path / "trace.json").read_text())
    assert document["baseTimeNanoseconds"] == 5_000_000
    assert [(e["name"], e["ts"]) for e in document["traceEvents"]] == [
        ("thread_name", 0),
        ("a", 10.0),
        ("b", 2001.0),  # 2 ms later base, in microseconds
    ]
    assert not any(segments.iterdir())


EXITS = """
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from omni_common.runtime.profiler import StageProfiler

profiler = StageProfiler("dit-denoise", torch.device("cpu"), sys.argv[1])
compute = ThreadPoolExecutor(1)
compute.submit(profiler.start, "").result()
x = torch.ones(8)
for _ in range(3):
    compute.submit(lambda: [torch.mul(x, 2.0) for _ in range(50)]).result()
    compute.submit(profiler.after_task).result()
if sys.argv[2] == "stop":
    written, _ = compute.submit(profiler.stop).result()
    print(written.result())
compute.submit(profiler.close).result()  # as Worker.close: on the compute thread
compute.shutdown()
"""


@pytest.mark.parametrize("ending", ["stop", "running at close"])
def test_a_process_that_profiled_exits_cleanly(tmp_path: Path, ending: str) -> None:
    """torch crashed a process at exit (rc 139) when a recording outlived its thread."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", textwrap.dedent(EXITS), str(tmp_path / "root"), ending]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if ending == "stop":
        assert Path(done.stdout.strip()).is_file()
    else:  # the running session was dropped, its segments with it
        [directory] = (tmp_path / "root").iterdir()
        assert not any(directory.iterdir())


def a_child_stops() -> int:
    """Blocks (no polling) until a child of this process is stopped: its pid."""
    info = os.waitid(os.P_ALL, 0, os.WSTOPPED | os.WNOWAIT)  # WNOWAIT: Popen still reaps it
    assert info is not None and info.si_code == os.CLD_STOPPED
    return info.si_pid


def test_the_merge_is_paused_while_a_task_runs_and_finishes_once_idle(compute: ComputeThread) -> None:
    directory = compute.run(compute.profiler.start, "paused")
    compute.run(multiplies, 3)

    def stop_and_compute() -> Future[Path]:  # one task: the merge starts while it runs
        written, _ = compute.profiler.stop()
        a_child_stops()
        assert not written.done()
        assert [path.name.startswith(".segments-") for path in directory.iterdir()] == [True]
        return written

    written = compute.run(stop_and_compute)
    trace = written.result()  # the compute thread is idle: the merge runs to its end
    assert sum(event.get("name") == "aten::mul" for event in events(trace)) == 3
    assert os.listdir(directory) == [trace.name]


def test_closing_with_a_paused_merge_leaves_no_process_behind(compute: ComputeThread) -> None:
    compute.run(compute.profiler.start, "closing")
    compute.run(multiplies, 2)
    paused: queue.Queue[tuple[Future[Path], int]] = queue.Queue()
    release = threading.Event()

    def stop_and_hold() -> None:  # a task that outlasts the close: the merge stays paused
        written, _ = compute.profiler.stop()
        paused.put((written, a_child_stops()))
        release.wait()

    task = compute.pool.submit(compute._bounded, stop_and_hold, ())
    written, pid = paused.get()
    compute.profiler.close()  # continues the merge and waits for it
    assert written.done()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    release.set()
    task.result()
    assert sum(event.get("name") == "aten::mul" for event in events(written.result())) == 2


DIES = """
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from omni_common.runtime.profiler import StageProfiler

profiler = StageProfiler("dit-denoise", torch.device("cpu"), sys.argv[1])
compute = ThreadPoolExecutor(1)
compute.submit(profiler.start, "").result()
compute.submit(lambda: [torch.mul(torch.ones(8), 2.0) for _ in range(50)]).result()
compute.submit(profiler.after_task).result()


def stop_and_die():
    profiler.before_task()
    profiler.stop()
    info = os.waitid(os.P_ALL, 0, os.WSTOPPED | os.WNOWAIT)
    print(info.si_pid, flush=True)
    os._exit(0)  # killed while a task runs: the merge is left paused


compute.submit(stop_and_die).result()
"""


def test_a_replica_that_dies_leaves_no_paused_merge_behind(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", textwrap.dedent(DIES), str(tmp_path / "root")]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        pidfd = os.pidfd_open(int(done.stdout))
    except ProcessLookupError:  # continued and already gone
        return
    try:  # readable once the process has ended: the kernel continued it at its parent's death
        assert select.select([pidfd], [], [])[0] == [pidfd]
    finally:
        os.close(pidfd)
