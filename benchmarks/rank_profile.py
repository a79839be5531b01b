"""Where each rank of a replica over several devices spends its steps, from one profile of the
replica (StartProfile, requests, StopProfile: the server's trace, and each rank's in rank-N/
beside it, rank.RankProfile).

    python benchmarks/rank_profile.py PROFILE_DIR     (the directory StopProfile's trace is in)

A profiled rank marks each command it runs ("rank Step", "rank Prepare", ...). On a GPU a
Step's mark is its launch only: the rank answers it later, after launching the next one, and
marks that wait ("rank Answer"); a step there runs from one Answer's end to the next's (an idle
gap between requests makes one long step, which the medians pass over). On the CPU a step is
its Step mark. One JSON line per rank:
- `steps`, and the median wall time of one (`step_ms`);
- the GPU's kernel time per step by class (matmul, attention, triton, other; `nccl`: the
  all-to-alls and gathers, which include the wait for the slower peer);
- `busy_ms`: the union of the kernels' intervals in a step (NCCL overlapping compute counts
  once), and `idle_ms` = step - busy: the device waiting on this rank's host (launches, the
  step's arithmetic, the sync that ends a step);
- `between_ms`: the median time from one Step's end to the next one's start: the rank waiting
  for its server (the answer, the scheduler, the next command, any Read in between); none on
  a GPU, where the next Step is launched before the last one ends (its wait is `idle_ms`).
On the CPU (gloo ranks) there are no kernels: the step and between times remain.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from dit_profile import kernel_class

STEP = "rank Step"  # RankProfile's mark of a Step command
ANSWER = "rank Answer"  # its mark of the wait for a step's end, before answering it (GPU)


def load_events(trace: Path) -> list[dict[str, Any]]:
    with open(trace, "rb") as source:
        events: list[dict[str, Any]] = json.load(source)["traceEvents"]
    return [event for event in events if event.get("ph") == "X" and "dur" in event]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(trace: Path) -> dict[str, Any]:
    """One rank's steps, by the definitions in the module's docstring (milliseconds)."""
    events = load_events(trace)

    def marks(name: str) -> list[tuple[float, float]]:
        return sorted(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in events
            if e.get("name") == name and e.get("cat") == "user_annotation"  # the host's, not the GPU's
        )

    answered = [end for _, end in marks(ANSWER)]
    steps = list(itertools.pairwise(answered)) if answered else marks(STEP)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_class: dict[str, list[float]] = defaultdict(list)
    busy, idle = [], []
    for start, end in steps:
        inside = [
            (max(float(k["ts"]), start), min(float(k["ts"]) + float(k["dur"]), end), k["name"])
            for k in kernels
            if float(k["ts"]) < end and float(k["ts"]) + float(k["dur"]) > start
        ]
        classes: dict[str, float] = defaultdict(float)
        for lo, hi, name in inside:
            classes["nccl" if "nccl" in name.lower() else kernel_class(name)] += hi - lo
        for kind in ("matmul", "attention", "triton", "nccl", "other"):
            by_class[kind].append(classes[kind])
        covered = union_us([(lo, hi) for lo, hi, _ in inside])
        busy.append(covered)
        idle.append(end - start - covered)
    between = [] if answered else [b[0] - a[1] for a, b in itertools.pairwise(steps)]

    def ms(values: list[float]) -> float | None:
        return round(statistics.median(values) / 1e3, 2) if values else None

    return {
        "trace": str(trace),
        "steps": len(steps),
        "step_ms": ms([end - start for start, end in steps]),
        "kernels_ms": {kind: ms(values) for kind, values in by_class.items()},
        "busy_ms": ms(busy),
        "idle_ms": ms(idle),
        "between_ms": ms(between),
    }


def rank_traces(directory: Path, ranks: int, timeout_s: float = 600.0) -> list[Path]:
    """Each rank's trace under `directory`/rank-N, waited for: a rank's trace appears (whole)
    once its merge process has written it, after StopProfile answered."""
    deadline = time.monotonic() + timeout_s
    found: list[Path] = []
    for rank in range(ranks):
        while not (traces := sorted((directory / f"rank-{rank}").glob("*.json"))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no trace of rank {rank} under {directory} after {timeout_s:.0f} s")
            time.sleep(0.5)
        found.append(traces[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path, help="the profile's directory (StopProfile's trace is in it)")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    for rank, trace in enumerate(rank_traces(args.directory, args.ranks)):
        print(json.dumps({"rank": rank, **summarize(trace)}), flush=True)


if __name__ == "__main__":
    main()
