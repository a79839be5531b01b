"""`omnistage serve gateway` as a real process: it says where it listens (port 0 works),
answers health, and SIGTERM stops it cleanly through its drain (exit status 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from omni_common.cluster import free_port

pytestmark = pytest.mark.slow


def test_serve_gateway_starts_answers_health_and_stops_on_sigterm() -> None:
    env = {
        **os.environ,
        "OMNISTAGE_PORT": "0",
        # No coordinator there: the gateway itself still starts and is healthy.
        "OMNISTAGE_COORDINATOR": f"127.0.0.1:{free_port()}",
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "omni_common.cli", "serve", "gateway"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert gateway.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = gateway.stdout.readline()
            lines.append(line)
            if line.startswith("gateway ready on ") or gateway.poll() is not None:
                break
        assert lines[-1].startswith("gateway ready on "), "".join(lines)
        url = "http://" + lines[-1].split()[-1]
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        response = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat"}, timeout=30)
        assert response.status_code == 503  # nothing at the coordinator's address
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(30) == 0
        rest = gateway.stdout.read()
        assert "gateway stopped" in rest, rest
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
