"""A launcher killed outright (pytest, a user's script: SIGKILL, no `stop`) leaves nothing behind:
every service of its LocalCluster sees that its parent is gone, drains as on SIGTERM and exits,
and no shared-memory segment of theirs remains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_common.client import Client
from tests.conftest import assert_no_segment_added, omnistage_segments, running, segment_owner

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The launcher: starts a cluster, prints its coordinator and the pids of its processes, then
# waits to be killed. Every hop goes through shared memory (no tensor inline).
LAUNCHER = """
import json, signal, sys
from pathlib import Path
from omni_common.cluster import LocalCluster, loopback_plan

plan = loopback_plan(Path(sys.argv[1]), extra_env={"OMNISTAGE_INLINE_BYTES": "0"})
cluster = LocalCluster(plan, log_dir=Path(sys.argv[2]))
cluster.start()
print(json.dumps([cluster.coordinator, sorted(cluster.pids)]), flush=True)
signal.pause()
"""


def test_killing_the_launcher_stops_every_service_and_frees_their_memory(
    tiny_model: Path, tmp_path: Path
) -> None:
    before = omnistage_segments()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tiny_model), str(tmp_path)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()  # the cluster is healthy: LocalCluster.start returned
        assert line, f"the launcher exited with status {launcher.wait()} before its cluster was up"
        coordinator, started = json.loads(line)
        pids = set(started)
        assert len(pids) == 4  # the coordinator and one replica of each stage
        with Client(coordinator) as client:  # the stages' tensors cross in their arenas
            client.generate("left behind?", width=64, height=64, steps=2)
        theirs = {name for name in omnistage_segments() - before if segment_owner(name) in pids}
        assert theirs, "the services hold no shared memory: the check below would prove nothing"
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 120  # a drain takes a poll of the parent, then the grace of idle work
    while (alive := {pid for pid in pids if running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # a failed check leaves no process behind
        os.kill(pid, signal.SIGTERM)
    assert not alive, f"services outlived their launcher: {sorted(alive)}"
    assert_no_segment_added(before, owners=pids)
