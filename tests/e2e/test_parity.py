"""A cluster of real processes draws the same pixels as diffusers' QwenImagePipeline in one
process, on the same weights and seed (DESIGN.md: the split is bitwise, fp32 and bf16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from omni_common.client import Client

pytestmark = pytest.mark.slow

CASES = {
    "no-cfg": {"prompt": "a tiny red house", "negative_prompt": "", "guidance": 1.0},
    "true-cfg-4": {"prompt": "a tiny red house", "negative_prompt": "blurry", "guidance": 4.0},
}


def diffusers_pixels(model: Path, dtype: str, case: dict, seed: int) -> np.ndarray:
    pipe = QwenImagePipeline.from_pretrained(model, dtype=getattr(torch, dtype))
    image = pipe(
        case["prompt"],
        negative_prompt=case["negative_prompt"] or None,
        true_cfg_scale=case["guidance"],
        width=64,
        height=64,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(seed),
        output_type="pil",
    ).images[0]
    return np.asarray(image)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cluster_pixels_equal_diffusers_bitwise(process_cluster, tiny_model: Path, case: str) -> None:
    address, dtype = process_cluster
    options = CASES[case]
    with Client(address) as client:
        image = client.generate(
            options["prompt"],
            negative_prompt=options["negative_prompt"],
            guidance=options["guidance"],
            width=64,
            height=64,
            steps=4,
            seed=11,
        )
    expected = diffusers_pixels(tiny_model, dtype, options, seed=11)
    assert np.asarray(image).shape == expected.shape == (64, 64, 3)
    assert np.array_equal(np.asarray(image), expected), (
        f"max pixel difference {np.abs(np.asarray(image).astype(int) - expected).max()}"
    )
