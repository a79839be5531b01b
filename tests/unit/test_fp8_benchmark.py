"""benchmarks/fp8.py's smallest real path: the tiny fixture on the CPU, eager, both dtypes, and
the comparison line the lead reads on an H100."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_fp8_benchmark_runs_both_dtypes_and_compares_them(tiny_model: Path) -> None:
    command = [sys.executable, str(REPO / "benchmarks" / "fp8.py"), "--model", str(tiny_model)]
    command += ["--device", "cpu", "--size", "32", "--steps", "2", "--blocks", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "# a subset: the first 1 of 2 blocks"
    rows = [json.loads(line) for line in lines[1:]]
    assert [row.get("dtype") for row in rows[1:3]] == ["float32", "fp8"]
    assert all(row["step_ms_p50"] > 0 for row in rows[1:3])
    summary = rows[3]
    assert summary["blocks"] == "1 of 2" and summary["fp8_over_bf16_step"] > 0
    assert 0 < summary["max_abs_latent_diff"] < 0.1  # FP8, not the same numbers, not garbage
    assert summary["latent_psnr_db"] > 30
