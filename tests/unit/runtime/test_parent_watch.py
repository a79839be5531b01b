"""A service started with --parent-pid stops, as on SIGTERM, once its launcher is gone: the
launcher killed outright (SIGKILL) cannot stop it, and it is reparented."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The launcher starts the service and prints both pids; the service watches the launcher,
# and says so (a line on the pipe they share) once its SIGTERM handler stands.
LAUNCHER = """
import json, subprocess, sys
service = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print(json.dumps([service.pid]), flush=True)
service.wait()
"""
SERVICE = """
import os, signal, sys
from omni_common.runtime.serve import stop_with_parent

def drained(*_):
    with open(sys.argv[1] + ".tmp", "w") as file:
        file.write("drained")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    sys.exit(0)

signal.signal(signal.SIGTERM, drained)
stop_with_parent(os.getppid())
print("watching", flush=True)
signal.pause()
"""


def test_a_service_stops_once_its_launcher_is_killed(tmp_path: Path) -> None:
    drained = tmp_path / "drained"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SERVICE, str(drained)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None
        (service,) = json.loads(launcher.stdout.readline())
        assert launcher.stdout.readline() == "watching\n"
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 30
    while not drained.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(service, signal.SIGKILL)  # a failed check leaves no process behind
    assert drained.exists(), f"service {service} did not stop when its launcher died"
