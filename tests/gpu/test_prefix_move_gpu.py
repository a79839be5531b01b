"""A conversation's prefix KV moved between two thinkers on one GPU (tiny Qwen2.5-Omni, float32),
as the replicas move it: the benchmark's "moved" row hands it over by CUDA IPC to a Thinker in
another process, which installs it and hits (the script exits non-zero when it does not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC)"),
]

REPO = Path(__file__).resolve().parents[2]


def test_a_prefix_moves_by_cuda_ipc_and_is_reused(omni_model: Path) -> None:
    script = REPO / "benchmarks" / "omni_prefix_reuse.py"
    command = [sys.executable, str(script), "--model", str(omni_model), "--device", "cuda", "--rounds", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (moved,) = [row for row in rows if row.get("case") == "moved"]
    assert moved["handles"] == "cuda_ipc" and moved["moved_bytes"] > 0
