"""CUDA IPC between real processes on one GPU (skipped without CUDA).

This process is the producer; tests/gpu/ipc_peer.py is the other process. Run on a GPU
machine: `python -m pytest tests/gpu -m gpu -v` (about half a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_common.transport import Consumer, TensorTransport, gpu_uuid, ipc_namespace

from .ipc_peer import cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC between processes)"),
]

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda", 0)


def peer(role: str, data: bytes = b"", env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run the other process; returns its JSON report and its stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.gpu.ipc_peer", role],
        input=data,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    stderr = out.stderr.decode(errors="replace")
    assert out.returncode == 0, stderr[-3000:]
    return json.loads(out.stdout.decode().strip().splitlines()[-1]), stderr


@pytest.fixture
def producer() -> Iterator[tuple[TensorTransport, Consumer]]:
    tr = TensorTransport(inline_threshold=0)
    yield tr, Consumer("", ipc_namespace(), gpu_uuid(DEVICE))
    tr.close()


def test_another_process_opens_every_tensor_on_the_gpu_without_a_copy(producer) -> None:
    tr, here = producer
    tensors = cases(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    state = tr.export_state(tensors, {}, consumer=here)
    assert {ref.WhichOneof("location") for ref in state.tensors} == {"cuda_ipc"}
    assert {ref.name: ref.dtype for ref in state.tensors}["bfloat16"] == "bfloat16"
    exported = torch.cuda.memory_allocated(DEVICE) - before
    assert exported >= sum(ref.nbytes for ref in state.tensors)  # clones, held by the leases

    report, _ = peer("consume", state.SerializeToString())
    assert report == {"names": sorted(tensors), "bad": [], "allocated": 0, "forged": "PERMISSION_DENIED"}

    assert tr.release(tr.lease_ids(state)) == len(tensors)
    assert torch.cuda.memory_allocated(DEVICE) == before  # release gave the GPU memory back


def test_expired_lease_gives_the_gpu_memory_back() -> None:
    tr = TensorTransport(inline_threshold=0, lease_ttl_s=0.2)
    try:
        source = torch.ones(16 << 20, device=DEVICE)  # 64 MiB
        before = torch.cuda.memory_allocated(DEVICE)
        tr.export("x", source, consumer=Consumer("", ipc_namespace(), gpu_uuid(DEVICE)))
        assert torch.cuda.memory_allocated(DEVICE) - before >= source.nbytes
        deadline = time.monotonic() + 5
        while tr.live_leases() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tr.live_leases() == 0
        assert torch.cuda.memory_allocated(DEVICE) == before
    finally:
        tr.close()


def test_fetch_path_copies_a_gpu_lease_to_the_host(producer) -> None:
    tr, here = producer
    t = (torch.arange(3 << 18, device=DEVICE) % 997).to(torch.bfloat16)
    ref = tr.export("x", t, consumer=here)
    data = b"".join(
        tr.read_lease(ref.cuda_ipc.lease_id, off, 1 << 20) for off in range(0, ref.nbytes, 1 << 20)
    )
    assert data == t.cpu().view(torch.uint8).numpy().tobytes()


def test_consumer_without_cuda_is_told_unimplemented(producer) -> None:
    tr, here = producer
    state = tr.export_state({"x": torch.ones(1 << 16, device=DEVICE)}, {}, consumer=here)
    report, _ = peer("no-cuda", state.SerializeToString(), env={"CUDA_VISIBLE_DEVICES": ""})
    assert report["cuda"] is False
    assert report["outcome"].startswith("UNIMPLEMENTED") and "has no CUDA" in report["outcome"]


def test_expandable_segments_producer_stages_through_shm_and_says_so_once() -> None:
    report, stderr = peer("produce", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert report == {"locations": ["shm"], "bad": []}
    said = [line for line in stderr.splitlines() if "instead of CUDA IPC" in line]
    assert len(said) == 1 and "expandable_segments" in said[0]
