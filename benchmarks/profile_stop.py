"""What StopProfile costs the rest of a replica while it ends a trace (issue 38, finding 3).

    python benchmarks/profile_stop.py [--ops 20000 100000]

For each size, a StageProfiler records that many small operators on a "compute" thread, then
StopProfile runs as the replica runs it: the recording ends on the compute thread, the trace
is written on the writer thread. Meanwhile a third thread (standing in for the event loop:
health, heartbeats, other calls) wakes every 10 ms; its longest wait shows how long torch
held the GIL. Printed, one JSON line per size: seconds to stop, seconds to write, the
trace's size, the longest stall each phase caused, and the resident memory the recording
took (the quantity --profile-max-mb bounds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from omni_common.runtime.profiler import StageProfiler, resident_bytes


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


def measure(ops: int, root: Path) -> dict[str, object]:
    compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
    profiler = StageProfiler("bench", torch.device("cpu"), str(root))
    y = torch.ones(4)
    compute.submit(profiler.start, f"ops-{ops}").result()
    before = resident_bytes()
    compute.submit(lambda: [y.add(1) for _ in range(ops)]).result()
    grown = resident_bytes() - before
    stalls = Stalls()
    started = time.perf_counter()
    written, _ = compute.submit(profiler.stop).result()
    stop_s = time.perf_counter() - started
    stop_stall = stalls.close()
    stalls = Stalls()
    started = time.perf_counter()
    trace = written.result()
    write_s = time.perf_counter() - started
    write_stall = stalls.close()
    profiler.close()
    compute.shutdown()
    return {
        "ops": ops,
        "recorded_mb": round(grown / 2**20, 1),
        "stop_s": round(stop_s, 2),
        "stop_worst_stall_s": round(stop_stall, 2),
        "write_s": round(write_s, 2),
        "write_worst_stall_s": round(write_stall, 2),
        "trace_mb": round(trace.stat().st_size / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[20_000, 100_000])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        for ops in args.ops:
            print(json.dumps(measure(ops, Path(root) / "profiles")), flush=True)


if __name__ == "__main__":
    main()
