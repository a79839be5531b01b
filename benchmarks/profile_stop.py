"""What StopProfile costs the requests a replica serves meanwhile (issue 38, finding 3).

    python benchmarks/profile_stop.py [--ops 20000 100000] [--requests 8] [--trials 3]
                                      [--busy N] [--idle-ms MS]

A stand-in replica: one compute thread runs every task between the profiler's
`before_task` and `after_task` (as Worker does); a request is `--steps` tasks, each a forward of a small
transformer (like a DiT's steps). For each recording size, and for two ways of ending it:

- `segments`: the shipped StageProfiler (each task's events saved right after it, the
  trace joined by a separate process paused while a task runs), and
- `one-recording`: the same class with one segment for the whole session (segment_s=inf),
  the way StopProfile worked before: torch processes every event at the stop, holding the GIL,

it records `--ops` operator events while requests run, then a client sends requests back
to back while StopProfile ends the recording and the trace is written (`--trials` times).
Printed, one JSON line each, against the median unprofiled request (`--requests` run before
the profile and after each trace is written, as the machine's load drifts; their own worst
ratio shows the noise): the median ratio of the requests recorded (profiling's own cost,
which segments raise: each task's events are processed after it), the ratio of the first
request sent with StopProfile (the one a stall would hit), the median, 90th percentile and worst ratio of
all requests that overlapped StopProfile (from the call until the trace was on disk), the
seconds StopProfile took, the longest wait of a thread that wakes every 10 ms (the event
loop's view), the trace's size.

`--busy N` runs N busy loops (nice 0) throughout, as other tenants of a shared machine do;
`--idle-ms` makes the client wait between requests during the stop (a replica with spare
capacity; 0, the default, keeps it busy, and the merge then waits its patience).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from omni_common.runtime.profiler import StageProfiler

T = TypeVar("T")


class Stalls:
    """A thread that sleeps 10 ms at a time and records how late each wake-up was."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(0.01)
            self.worst = max(self.worst, time.perf_counter() - started - 0.01)

    def close(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.worst


class Replica:
    """A compute thread that runs tasks between the profiler's before_task and after_task."""

    def __init__(self, profiler: StageProfiler, steps: int) -> None:
        self.profiler = profiler
        self.steps = steps
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
        layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
        self.model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
        self.x = torch.randn(1, 512, 128)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        return self.compute.submit(self._bounded, fn, args).result()

    def _bounded(self, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        self.profiler.before_task()
        try:
            return fn(*args)
        finally:
            self.profiler.after_task()

    def _step(self) -> None:
        with torch.inference_mode():
            self.model(self.x)

    def request(self) -> float:
        """One request's seconds: its steps, each a task of the compute thread."""
        started = time.perf_counter()
        for _ in range(self.steps):
            self.run(self._step)
        return time.perf_counter() - started

    def ops_per_request(self) -> int:
        """Operator events one request records (a profiled request, counted in its trace)."""
        self.run(self.profiler.start, "count")
        self.request()
        written, _ = self.run(self.profiler.stop)
        return count_ops(written.result())

    def close(self) -> None:
        self.compute.submit(self.profiler.close).result()
        self.compute.shutdown()


def during_stop(replica: Replica, idle_s: float) -> tuple[list[float], float, float, Path]:
    """Requests back to back while StopProfile runs: their latencies, the stop's seconds,
    the event loop's longest wait, the trace."""
    latencies: list[float] = []
    stopping = threading.Event()
    done = threading.Event()

    def client() -> None:
        stopping.wait()
        while not done.is_set():
            latencies.append(replica.request())
            done.wait(idle_s)

    thread = threading.Thread(target=client)
    thread.start()
    stalls = Stalls()
    started = time.perf_counter()
    stopped = replica.compute.submit(replica._bounded, replica.profiler.stop, ())
    stopping.set()  # the first request queues behind the stop (one that ran first was profiled)
    written, _ = stopped.result()
    trace = written.result()
    stop_s = time.perf_counter() - started
    done.set()
    thread.join()
    return latencies, stop_s, stalls.close(), trace


def measure(ops: int, mode: str, args: argparse.Namespace, root: Path) -> dict[str, object]:
    segment_s = float("inf") if mode == "one-recording" else None
    profiler = StageProfiler("bench", torch.device("cpu"), str(root), segment_s=segment_s, max_seconds=3600)
    replica = Replica(profiler, args.steps)
    replica.request()  # warm
    unprofiled = [replica.request() for _ in range(args.requests)]
    per_request = replica.ops_per_request()
    first: list[float] = []
    profiled: list[float] = []
    overlapping: list[float] = []
    stops: list[float] = []
    stalls: list[float] = []
    for trial in range(args.trials):
        replica.run(profiler.start, f"{mode}-{ops}-{trial}")
        profiled += [replica.request() for _ in range(max(1, ops // per_request))]
        latencies, stop_s, stall, trace = during_stop(replica, args.idle_ms / 1000)
        first.append(latencies[0])
        overlapping += latencies
        stops.append(stop_s)
        stalls.append(stall)
        unprofiled += [replica.request() for _ in range(args.requests)]  # the load drifts
    replica.close()
    usual = statistics.median(unprofiled)
    return {
        "ops": ops,
        "mode": mode,
        "trace_ops": count_ops(trace),
        "trace_mb": round(trace.stat().st_size / 2**20, 1),
        "unprofiled_request_s": round(usual, 3),
        "unprofiled_worst_ratio": round(max(unprofiled) / usual, 2),
        "profiled_median_ratio": round(statistics.median(profiled) / usual, 2),
        "first_request_ratios": [round(latency / usual, 2) for latency in first],
        "requests_during_stop": len(overlapping),
        "median_ratio": round(statistics.median(overlapping) / usual, 2),
        "p90_ratio": round(statistics.quantiles(overlapping, n=10)[-1] / usual, 2),
        "worst_ratio": round(max(overlapping) / usual, 2),
        "stop_s": [round(seconds, 2) for seconds in stops],
        "event_loop_worst_stall_s": [round(stall, 2) for stall in stalls],
    }


def count_ops(trace: Path) -> int:
    events = json.loads(trace.read_text())["traceEvents"]
    return sum(1 for event in events if event.get("cat") == "cpu_op")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3, help="StopProfile calls per size and mode")
    parser.add_argument("--modes", nargs="+", default=["segments", "one-recording"])
    parser.add_argument("--busy", type=int, default=0, help="busy loops running meanwhile (other tenants)")
    parser.add_argument("--idle-ms", type=float, default=0.0, help="the client's wait between requests")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loop = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(loop) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory() as root:
            for ops in args.ops:
                for mode in args.modes:
                    result = measure(ops, mode, args, Path(root) / "profiles")
                    print(json.dumps(result), flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main()
