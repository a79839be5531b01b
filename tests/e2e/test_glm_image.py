"""GLM-Image in real processes: the cluster draws diffusers' GlmImagePipeline's pixels bit for
bit (text to image and edit, float32 and bfloat16), and requests whose condition KV and
denoising lived on a DiT replica killed with SIGKILL finish on the other one, the lost KV
produced again from the condition images."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.glm_image.reference import load_pipeline
from tests.conftest import assert_no_segment_added, omnistage_segments
from tests.e2e.conftest import kill_mid_denoise
from tests.glm import pipeline_image, png

pytestmark = pytest.mark.slow

STEPS = 3
PROMPT = "a shop sign that says 'open'"
EDIT_PROMPT = "make it red, add a sign saying 'hat'"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def glm_cluster(
    request: pytest.FixtureRequest, glm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    dtype = request.param
    # GLM-Image's CPU kernels (unlike Qwen-Image's) round differently with another thread
    # count: the stages and diffusers each compute on one thread, as equals.
    plan = loopback_plan(glm_model, dtype, {"OMNISTAGE_THREADS": "1"})
    with LocalCluster(plan, log_dir=tmp_path_factory.mktemp(f"glm-logs-{dtype}")) as cluster:
        yield cluster.coordinator, dtype


def diffusers_pixels(model: Path, dtype: str, prompt: str, seed: int, images: Sequence[bytes]) -> np.ndarray:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        image = pipeline_image(load_pipeline(model, getattr(torch, dtype)), prompt, seed, STEPS, images)
    finally:
        torch.set_num_threads(threads)
    # The pipeline's own conversion to PIL (VaeImageProcessor.numpy_to_pil).
    return (image.float().permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


@pytest.mark.parametrize("mode", ["text-to-image", "edit"])
def test_cluster_pixels_equal_the_pipeline_bitwise(glm_cluster, glm_model: Path, mode: str) -> None:
    address, dtype = glm_cluster
    prompt, images = (PROMPT, []) if mode == "text-to-image" else (EDIT_PROMPT, [png(4)])
    with Client(address) as client:
        image = client.generate(prompt, images=images, width=64, height=64, steps=STEPS, seed=21)
    expected = diffusers_pixels(glm_model, dtype, prompt, 21, images)
    got = np.asarray(image)
    assert got.shape == expected.shape == (64, 64, 3)
    assert np.array_equal(got, expected), f"max pixel difference {np.abs(got.astype(int) - expected).max()}"


# Edit requests denoise long enough to be killed mid-way.
EDIT = {"width": 64, "height": 64, "steps": 150, "return_tensor": True}


def edits(seeds: list[int]) -> dict[int, dict[str, object]]:
    return {seed: {"prompt": f"edit {seed}", "images": [png(seed)], "seed": seed, **EDIT} for seed in seeds}


def test_killed_dit_replica_edits_finish_elsewhere_recomputing_the_lost_kv(
    glm_model: Path, tmp_path: Path
) -> None:
    before = omnistage_segments()
    seeds = list(range(6))
    # No step cache: every request writes its own condition KV, on either replica. The second
    # replica stands on a host of its own (its own host id and shared-memory directory): KV
    # written on the first (the one killed) cannot reach it (on one host the segments would
    # outlive the process), and tensors cross between them as bytes, never inline.
    env = {"OMNISTAGE_STEP_CACHE_BYTES": "0", "OMNISTAGE_INLINE_BYTES": "0"}
    plan = loopback_plan(glm_model, extra_env=env, replicas={"dit-denoise": 2})
    (other_host,) = [process for process in plan if process.name == "dit-denoise-2"]
    (tmp_path / "shm-other-host").mkdir()
    other_host.environment.update(
        OMNISTAGE_HOST_ID="other-host", OMNISTAGE_SHM_DIR=str(tmp_path / "shm-other-host")
    )
    with LocalCluster(plan, log_dir=tmp_path) as cluster:
        log = kill_mid_denoise(cluster, edits(seeds))
    assert "moving on" in log, "no request failed over"
    assert "producing condition-kv again" in log, "no request lost its condition KV"
    assert_no_segment_added(before)
