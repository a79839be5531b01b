"""benchmarks/rank_profile.py's sums of one rank's trace: on a GPU a step runs from one "rank
Answer" mark's end to the next's (the rank launches step k+1 before it answers step k), on the
CPU a step is its "rank Step" mark."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rank_profile() -> Iterator[Any]:
    sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as scripts do
    import rank_profile

    yield rank_profile
    sys.path.remove(str(BENCHMARKS))


def mark(name: str, start_us: float, dur_us: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": start_us, "dur": dur_us}


def kernel(name: str, start_us: float, dur_us: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": dur_us}


def write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_pipelined_steps_run_from_answer_to_answer(rank_profile: Any, tmp_path: Path) -> None:
    # Steps k = 0..3 every 10 ms: launched 9 ms before the previous one ends, answered at its end.
    events = []
    for k in range(4):
        end = 10_000.0 * (k + 1)
        events.append(mark("rank Step", end - 19_000.0, 500.0))
        events.append(mark("rank Answer", end - 1_000.0, 1_000.0))
        events.append(kernel("sm90_gemm", end - 9_000.0, 6_000.0))  # 1 ms idle before, 2 after
        events.append(kernel("ncclDevKernel_SendRecv", end - 3_000.0, 1_000.0))
    summary = rank_profile.summarize(write(tmp_path / "rank.json", events))
    assert summary["steps"] == 3  # between the 4 answers
    assert summary["step_ms"] == 10.0
    assert summary["busy_ms"] == 7.0 and summary["idle_ms"] == 3.0
    assert summary["kernels_ms"]["nccl"] == 1.0
    assert summary["between_ms"] is None  # no gap between a Step's end and the next's start here


def test_cpu_steps_are_their_marks(rank_profile: Any, tmp_path: Path) -> None:
    events = [mark("rank Step", 10_000.0 * k, 8_000.0) for k in range(3)]
    summary = rank_profile.summarize(write(tmp_path / "rank.json", events))
    assert summary["steps"] == 3 and summary["step_ms"] == 8.0 and summary["between_ms"] == 2.0
