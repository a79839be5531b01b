"""`omnistage cluster up` runs docker-compose.yml's services as processes, serves, and on
Ctrl-C leaves no process and no shared-memory segment behind."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omni_common.client import Client
from tests.conftest import assert_no_segment_added, omnistage_segments

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_cluster_up_serves_the_default_model_scaled_over_tls_and_ctrl_c_leaves_nothing(
    tmp_path: Path,
) -> None:
    before = omnistage_segments()
    cli = [sys.executable, "-m", "omnistage_cli"]
    compose = str(REPO / "docker-compose.yml")
    up = [
        *cli,
        "cluster",
        "up",
        "--compose",
        compose,
        "--logs",
        str(tmp_path / "logs"),
        "--scale",
        "dit-denoise=2",
    ]
    launcher = subprocess.Popen(
        up, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        assert launcher.stdout is not None
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = launcher.stdout.readline()
            lines.append(line)
            if "cluster ready" in line or launcher.poll() is not None:
                break
        assert "cluster ready" in lines[-1], "".join(lines)
        assert "try it at http://127.0.0.1:8000/" in lines[-1]
        ca = REPO / ".secrets" / "tls" / "ca.pem"  # made by cluster up: every hop is TLS
        assert "; TLS;" in (tmp_path / "logs" / "coordinator.log").read_text()
        services = children_of(launcher.pid)
        assert len(services) == 6  # coordinator, encoder, two DiT replicas, VAE, gateway

        out = tmp_path / "seven.png"
        args = [
            "-o",
            str(out),
            "--width",
            "32",
            "--height",
            "32",
            "--steps",
            "20",
            "--guidance",
            "1",
            "--quiet",
            "--ca-cert",
            str(ca),
        ]
        done = subprocess.run(
            [*cli, "generate", "a handwritten digit seven", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert f"saved {out}" in done.stdout and out.read_bytes().startswith(b"\x89PNG")
        with Client("127.0.0.1:50051", ca_cert=ca) as client:
            (model,) = client.list_models()
            assert model.name == "qwen-image-digits"
            assert dict(model.replicas) == {"ar-encoder": 1, "dit-denoise": 2, "vae-decode": 1}
        # The gateway process serves the same image over HTTP (OpenAI's API).
        body = {"prompt": "a handwritten digit seven", "size": "32x32", "num_inference_steps": 20}
        body |= {"guidance_scale": 1, "seed": 0}
        response = httpx.post("http://127.0.0.1:8000/v1/images/generations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert base64.b64decode(response.json()["data"][0]["b64_json"]) == out.read_bytes()
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(90)
    assert launcher.returncode == 0
    assert not [pid for pid in services if alive(pid)]
    assert_no_segment_added(before, owners={launcher.pid, *services})
