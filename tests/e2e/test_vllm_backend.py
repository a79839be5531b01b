"""The ar-encoder's vLLM backend in real processes (skipped without vLLM): a whole generation
through a cluster with `--backend vllm` gives the torch backend's image, and an engine that
cannot start stops the service with a clear error instead of letting it report healthy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from omni_common.client import Client
from omni_common.cluster import LocalCluster, free_port, loopback_plan
from omni_common.compose import LOOPBACK
from omni_common.health import check_health
from omni_common.models.qwenimage.vllm_encoder import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (OMNISTAGE_VLLM=1 setup)"),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_common.models.qwenimage.fixture import build_tiny_fixture

    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "qwen-image-tiny-hd32", head_dim=32)


def generate(model: Path, backend: str, logs: Path) -> np.ndarray:
    plan = loopback_plan(model, "float32", {"OMNISTAGE_BACKEND": backend})
    with LocalCluster(plan, log_dir=logs) as cluster, Client(cluster.coordinator) as client:
        image = client.generate(
            "a red cat sitting on a blue mat",
            negative_prompt=" ",
            guidance=4.0,
            width=64,
            height=64,
            steps=4,
            seed=3,
        )
    return np.asarray(image)


def test_cluster_with_vllm_backend_gives_the_torch_image(
    wide_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with_torch = generate(wide_model, "torch", tmp_path_factory.mktemp("logs-torch"))
    with_vllm = generate(wide_model, "vllm", tmp_path_factory.mktemp("logs-vllm"))
    assert with_torch.shape == (64, 64, 3) and with_torch.std() > 0
    # Embeddings agree within ~1e-6; after 4 denoise steps and the VAE the 8-bit pixels match.
    assert np.array_equal(with_vllm, with_torch)


def test_engine_start_failure_is_a_clear_error_and_never_healthy(tiny_model: Path, tmp_path: Path) -> None:
    """A model whose text encoder has no weights: vLLM's engine fails while loading."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    for shard in (broken / "text_encoder").glob("*.safetensors"):
        shard.unlink()
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "omnistage_cli", "serve", "ar-encoder", "--backend", "vllm"],
        env={
            **os.environ,
            "OMNISTAGE_MODEL": str(broken),
            "OMNISTAGE_PORT": str(port),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 240
    try:
        while process.poll() is None and time.monotonic() < deadline:
            assert not check_health(f"{LOOPBACK}:{port}", timeout_s=0.5)
            time.sleep(0.5)
        assert process.poll() is not None, "a failed engine start must not hang the service"
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read().decode(errors="replace") if process.stdout else ""
    assert process.returncode != 0
    assert "ar-encoder: the vLLM engine failed to start" in output
