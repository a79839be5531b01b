"""A vae-decode replica over two devices (--devices cpu,cpu) in a cluster of real gRPC servers:
an image above --split-decode-pixels is decoded in bands, a device each, and is the image of
diffusers' QwenImagePipeline with its VAE's tiling set to those bands (`band_tiling`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from omni_common.client import Client
from omni_common.models.qwenimage.decode import band_tiling
from tests.integration.conftest import InProcessCluster

pytestmark = pytest.mark.slow

SIZE = {"width": 48, "height": 160, "steps": 4}  # cut in two bands: 80 rows + 64 blended


@pytest.fixture(scope="module")
def banded(tiny_model: Path) -> Iterator[InProcessCluster]:
    options = {"devices": ("cpu", "cpu"), "split_decode_pixels": 48 * 160}
    running = InProcessCluster(tiny_model, stage_options={"vae-decode": options})
    running.start()
    yield running
    running.stop()


def test_a_large_image_decoded_over_two_devices_is_diffusers_tiled_image(
    banded: InProcessCluster, tiny_model: Path
) -> None:
    with Client(banded.coordinator) as client:
        ours = client.generate_result("a red boat", seed=3, return_tensor=True, **SIZE).tensor
    assert ours is not None and ours.shape == (3, 160, 48)
    pipe = QwenImagePipeline.from_pretrained(tiny_model, dtype=torch.float32)
    pipe.vae.enable_tiling(**band_tiling(160, 48, bands=2, scale=pipe.vae_scale_factor))
    want = pipe(
        "a red boat",
        width=48,
        height=160,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
    ).images[0]
    difference = float(np.abs(ours - want.numpy()).max())
    print(f"banded decode vs diffusers' tiled pipeline: max difference {difference:.3g}")
    assert difference <= 1e-6
