"""Real processes: a 256 MiB tensor crosses through shm; a killed producer's files are swept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from omni_common.transport import TensorTransport, sweep_stale_segments

from .conftest import SHM, shm_files

pytestmark = pytest.mark.slow

CONSUMER = """
import sys, torch
from omni_common.transport import TensorTransport
from omnistage.v1 import tensor_pb2
ref = tensor_pb2.TensorRef.FromString(sys.stdin.buffer.read())
tr = TensorTransport()
t = tr.import_tensor_sync(ref)
print(int(t.view(torch.int64).sum()), int(t.view(torch.int64)[-1]))
tr.close()
"""

PRODUCER = """
import sys, time, torch
from omni_common.transport import TensorTransport
tr = TensorTransport(segment_bytes=1 << 20)
ref = tr.export("x", torch.ones(1 << 16))
print(tr.token, flush=True)
time.sleep(60)
"""


def test_256_mib_tensor_crosses_to_another_process(make_transport) -> None:
    tr = make_transport()
    n = (256 << 20) // 8
    t = torch.arange(n, dtype=torch.int64)
    ref = tr.export("big", t)
    assert ref.WhichOneof("location") == "shm"
    out = subprocess.run(
        [sys.executable, "-c", CONSUMER],
        input=ref.SerializeToString(),
        capture_output=True,
        timeout=60,
        check=True,
    )
    total, last = map(int, out.stdout.split())
    assert (total, last) == (n * (n - 1) // 2, n - 1)
    assert tr.release([ref.shm.lease_id]) == 1


def test_sweep_removes_a_killed_producers_segments_only(make_transport) -> None:
    live = make_transport(inline_threshold=0)
    live.export("x", torch.ones(1000))
    child = subprocess.Popen([sys.executable, "-c", PRODUCER], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        token = child.stdout.readline().decode().strip()
        theirs = {f"omnistage-{token}-0", f"omnistage-{token}-leases"}
        assert theirs <= shm_files()
        assert sweep_stale_segments(SHM) == 0  # the producer is alive: untouched
        os.kill(child.pid, signal.SIGKILL)
        # Killed but not yet reaped (a zombie, as under a supervisor that has not waited yet):
        # already dead for the sweep.
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1].startswith("Z"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert theirs <= shm_files()
        assert sweep_stale_segments(SHM) == 2
        assert not theirs & shm_files()
        child.wait(timeout=10)
        assert {f"omnistage-{live.token}-0", f"omnistage-{live.token}-leases"} <= shm_files()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for name in shm_files():
            if token and token in name:
                os.unlink(f"{SHM}/{name}")


def test_new_transport_sweeps_on_start(tmp_path) -> None:
    token = "ab" * 8
    (tmp_path / f"omnistage-{token}-0").write_bytes(b"x")
    from omni_common.transport.lease_table import HEADER, MAGIC, VERSION
    from omni_common.transport.owner import pid_namespace

    dead_pid = 2**22 + 12345  # above pid_max on common systems
    header = HEADER.pack(MAGIC, VERSION, 1, dead_pid, pid_namespace(), 0)
    (tmp_path / f"omnistage-{token}-leases").write_bytes(header.ljust(128, b"\0"))
    (tmp_path / "omnistage-notours").write_bytes(b"keep")
    tr = TensorTransport(shm_dir=tmp_path)
    tr.close()
    assert [p.name for p in tmp_path.iterdir()] == ["omnistage-notours"]
