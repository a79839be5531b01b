"""StageProfiler on CUDA (skipped without CUDA): segments that end between tasks keep every
operator and its kernels, and a process that profiled the GPU, a CUDA graph replaying in
every segment, exits cleanly (torch notes CUPTI re-initialisation next to CUDA graphs
crashed before CUDA 12.6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from omni_common.runtime.profiler import StageProfiler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda", 0)


def matmuls(count: int) -> None:
    x = torch.randn(256, 256, device=DEVICE)
    for _ in range(count):
        x = torch.mm(x, x).tanh()


@pytest.mark.parametrize("segment_s", [0.0, None])  # a segment per task; the CUDA default
def test_cuda_segments_keep_every_operator_and_kernel(tmp_path: Path, segment_s: float | None) -> None:
    profiler = StageProfiler("dit-denoise", DEVICE, str(tmp_path), segment_s=segment_s)
    compute = ThreadPoolExecutor(1)

    def task(count: int) -> None:
        profiler.before_task()
        try:
            matmuls(count)
        finally:
            profiler.after_task()

    try:
        compute.submit(profiler.start, "gpu").result()
        for count in (2, 3, 4):
            compute.submit(task, count).result()
        written, _ = compute.submit(profiler.stop).result()
        events = json.loads(written.result().read_text())["traceEvents"]
    finally:
        compute.submit(profiler.close).result()
        compute.shutdown()
    assert sum(event.get("name") == "aten::mm" for event in events) == 9
    assert any(event.get("cat") == "kernel" for event in events)


EXITS = """
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from omni_common.runtime.profiler import StageProfiler

device = torch.device("cuda", 0)
profiler = StageProfiler("dit-denoise", device, sys.argv[1], segment_s=0.0)
compute = ThreadPoolExecutor(1)
compute.submit(profiler.start, "").result()
x = torch.randn(128, 128, device=device)
torch.mm(x, x)  # warm, then a CUDA graph replayed in every segment (CUPTI re-initialised)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = torch.mm(x, x)
for _ in range(4):
    compute.submit(lambda: (graph.replay(), torch.mm(x, x).sum().item())).result()
    compute.submit(profiler.after_task).result()
written, _ = compute.submit(profiler.stop).result()
print(written.result())
compute.submit(profiler.close).result()
compute.shutdown()
"""


def test_a_process_that_profiled_the_gpu_exits_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", textwrap.dedent(EXITS), str(tmp_path / "root")]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).is_file()
