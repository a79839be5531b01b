"""LocalCluster.stop: a process that outlives the grace period is killed with every process it
started (its process group), not alone."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omni_common.cluster import LocalCluster, descendants
from omni_common.compose import LocalProcess
from tests.conftest import running

# A service that ignores SIGTERM and has started a child, which ignores it too (an ignored
# signal stays ignored across exec): only a SIGKILL of the group ends both.
STUBBORN = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
signal.pause()
"""


def wait_until(condition: Callable[[], object], timeout_s: float = 30.0) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; whether it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def test_what_outlives_the_grace_is_killed_with_the_processes_it_started(tmp_path: Path) -> None:
    proc = LocalProcess("stubborn", [sys.executable, "-c", STUBBORN], {}, "")
    cluster = LocalCluster([proc], log_dir=tmp_path)
    cluster._spawn(proc)  # as `start` does, without the health check it has none of
    service = cluster.processes["stubborn"].pid
    assert wait_until(lambda: descendants({service}))
    (child,) = descendants({service})

    cluster.stop(grace_s=0.5)

    assert not running(service)
    child_gone = wait_until(lambda: not running(child))
    if not child_gone:
        os.kill(child, signal.SIGKILL)  # a failed check leaves no process behind
    assert child_gone, "the service's child outlived the cluster's stop"
