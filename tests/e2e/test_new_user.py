"""What a new user does, following only the README and docs/: serve a fixture with `omnistage
cluster up --model DIR`, call it with the CLI (an image and an edit; a spoken reply and a
text-only one), read the model's defaults, and meet the hints a first try needs.

Every command is the README's, run as a process. The compose file is the repository's with
its ports moved to free ones and its secrets in a temporary directory, so that another
cluster on the host (a test beside this one, an engineer's) never collides with it.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from omni_common.cluster import descendants, free_port
from tests.conftest import assert_no_segment_added, omnistage_segments

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "omnistage_cli"]
COMPOSE_PORTS = ("50051", "50061", "50062", "50063", "8000")


@dataclass
class UpCluster:
    """A running `omnistage cluster up`: its ready line, where to call it, how to trust it."""

    ready: str
    address: str
    ca: Path

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`omnistage ARGS --address ... --ca-cert ...`, as the README's commands run."""
        return run_cli(*args, "--address", self.address, "--ca-cert", str(self.ca), check=check)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "Traceback" not in done.stderr, done.stderr
    if check:
        assert done.returncode == 0, done.stderr
    return done


def local_compose(tmp: Path) -> tuple[Path, dict[str, str]]:
    """docker-compose.yml with free ports, and the environment that puts its secrets in `tmp`."""
    text = (REPO / "docker-compose.yml").read_text()
    ports = {port: str(free_port()) for port in COMPOSE_PORTS}
    # Quoted ports, host:port pairs and URLs: every place the file names a port.
    text = re.sub(r"(?<![0-9])(50051|50061|50062|50063|8000)(?![0-9])", lambda m: ports[m.group(1)], text)
    path = tmp / "docker-compose.yml"
    path.write_text(text)
    return path, {"OMNISTAGE_SECRETS": str(tmp / "secrets"), "COORDINATOR": f"127.0.0.1:{ports['50051']}"}


@pytest.fixture
def cluster_up(tmp_path: Path) -> Iterator[Callable[[Path], UpCluster]]:
    """Start `omnistage cluster up --model DIR` and yield a function that does it; Ctrl-C at the
    end, then nothing of it may be left: no process, no shared-memory segment."""
    before = omnistage_segments()
    launchers: list[subprocess.Popen[str]] = []
    owners: set[int] = set()

    def up(model: Path) -> UpCluster:
        compose, env = local_compose(tmp_path)
        launcher = subprocess.Popen(
            [*CLI, "cluster", "up", "--model", str(model), "--compose", str(compose)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd=REPO,
            env={**os.environ, "OMNISTAGE_SECRETS": env["OMNISTAGE_SECRETS"]},
        )
        launchers.append(launcher)
        assert launcher.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and launcher.poll() is None:
            lines.append(launcher.stdout.readline())
            if "cluster ready" in lines[-1]:
                break
        assert "cluster ready" in lines[-1], "".join(lines)
        owners.update({launcher.pid, *descendants({launcher.pid})})
        return UpCluster(lines[-1], env["COORDINATOR"], Path(env["OMNISTAGE_SECRETS"]) / "tls" / "ca.pem")

    yield up
    for launcher in launchers:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(90) == 0
    assert not [pid for pid in owners if alive(pid)]
    assert_no_segment_added(before, owners)


def test_a_new_user_serves_glm_image_generates_an_image_and_an_edit(
    cluster_up: Callable[[Path], UpCluster], glm_model: Path, tmp_path: Path
) -> None:
    cluster = cluster_up(glm_model)
    # The ready line names the model and what a client needs to reach a TLS cluster.
    assert "serving glm-image-tiny" in cluster.ready and "--ca-cert" in cluster.ready

    # A first try without the CA: the error says what to pass, in one line, no traceback.
    out = str(tmp_path / "x.png")
    bare = run_cli("generate", "a sign", "-o", out, "--address", cluster.address, check=False)
    assert bare.returncode == 1 and "UNAVAILABLE" in bare.stderr and "--ca-cert" in bare.stderr, bare.stderr

    # `omnistage models` shows the fixture's own defaults (its omnistage.json).
    models = cluster.cli("models").stdout
    assert "glm-image-tiny (glm-image, ready)" in models, models
    assert "height 64" in models and "num_inference_steps 4" in models and "width 64" in models, models

    # Generate with no size or steps: the model's defaults, 64x64 in 4 steps.
    sign = tmp_path / "sign.png"
    cluster.cli("generate", "a sign that says 'open'", "-o", str(sign), "--quiet")
    assert Image.open(sign).size == (64, 64)
    edited = tmp_path / "edited.png"
    cluster.cli("generate", "make it red", "--image", str(sign), "-o", str(edited), "--quiet")
    image = Image.open(io.BytesIO(edited.read_bytes()))
    assert image.format == "PNG" and image.size == (64, 64)


def test_a_new_user_serves_qwen_omni_speaks_a_wav_and_gets_a_text_only_reply(
    cluster_up: Callable[[Path], UpCluster], omni_model: Path, tmp_path: Path
) -> None:
    cluster = cluster_up(omni_model)
    assert "serving qwen-omni-tiny" in cluster.ready
    models = cluster.cli("models").stdout
    assert "max_new_tokens=<int in [1, 8192], default 16>" in models, models

    reply = tmp_path / "hi.wav"
    spoken = cluster.cli("speak", "Say hi.", "-o", str(reply), "--quiet")
    assert f"saved {reply}" in spoken.stdout
    with wave.open(str(reply), "rb") as wav:  # what `sox --i` reads: a mono 16-bit PCM WAV
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24_000)
        seconds = wav.getnframes() / wav.getframerate()
    assert 0 < seconds <= 2.5  # the fixture's short default: 100 codec tokens, 2 s
    if shutil.which("sox"):
        info = subprocess.run(["sox", "--i", "-D", str(reply)], capture_output=True, text=True, check=True)
        assert abs(float(info.stdout) - seconds) < 0.01

    text_only = tmp_path / "none.wav"
    written = cluster.cli("speak", "Say hi.", "-o", str(text_only), "--option", "audio=0", "--quiet")
    lines = written.stdout.splitlines()  # the reply's text (a random model's: any), then the note
    assert len(lines) >= 2 and "not written" in lines[-1], written.stdout
    assert not text_only.exists()


def test_a_stage_that_cannot_start_ends_cluster_up_in_one_line(tmp_path: Path) -> None:
    not_a_model = tmp_path / "empty-dir"
    not_a_model.mkdir()
    compose, env = local_compose(tmp_path)
    logs = str(tmp_path / "logs")
    done = subprocess.run(
        [*CLI, "cluster", "up", "--model", str(not_a_model), "--compose", str(compose), "--logs", logs],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMNISTAGE_SECRETS": env["OMNISTAGE_SECRETS"]},
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    # The stage, then its own one-line cause, then where its log is.
    stage = "(ar-encoder|dit-denoise|vae-decode)"
    assert re.match(rf"error: {stage} exited with status 1 while starting: {stage}: ", line), line
    assert "has no model_index.json" in line, line
