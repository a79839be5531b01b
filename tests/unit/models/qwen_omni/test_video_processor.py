"""The Omni processor's video part: frames become patches as Qwen2-VL's video processor lays
them out. Each patch row holds, per channel, the `temporal_patch_size` frames of its group in
order, each frame's pixels exactly as the image processor makes that frame's; a still video is
its image; an odd frame count repeats the last frame; the grid says (groups, rows, columns)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omni_common.models.qwen_omni.processor import IMAGE_PROCESSOR
from omni_common.models.qwen_omni.video_processor import FrameProcessor

SIZE = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}


@pytest.fixture(scope="module")
def images() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR)


def frame(seed: int, width: int = 60, height: int = 90) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_patches(images: Qwen2VLImageProcessorPil, picture: Image.Image) -> torch.Tensor:
    """The image processor's patches of one frame at the video size: [rows, C, t, p, p]."""
    out = images([picture], size=SIZE, return_tensors="pt")
    return out["pixel_values"].view(out["pixel_values"].shape[0], 3, 2, 14, 14)


def test_each_patch_row_holds_its_groups_frames_in_order(images: Qwen2VLImageProcessorPil) -> None:
    frames = [frame(seed) for seed in range(4)]
    out = FrameProcessor(images)(videos=[frames], size=SIZE, return_tensors="pt")
    grid_t, grid_h, grid_w = out["video_grid_thw"][0].tolist()
    assert grid_t == 2 and grid_h * 14 * grid_w * 14 <= SIZE["longest_edge"]
    rows = out["pixel_values_videos"].view(grid_t, grid_h * grid_w, 3, 2, 14, 14)
    for group in range(grid_t):
        for slot in range(2):
            expected = image_patches(images, frames[2 * group + slot])[:, :, 0]
            assert torch.equal(rows[group, :, :, slot], expected), (group, slot)


def test_a_still_video_is_its_image_and_an_odd_count_repeats_the_last_frame(
    images: Qwen2VLImageProcessorPil,
) -> None:
    still = frame(7)
    processor = FrameProcessor(images)
    one = processor(videos=[[still]], size=SIZE, return_tensors="pt")
    pixels = images([still], size=SIZE, return_tensors="pt")
    assert torch.equal(one["pixel_values_videos"], pixels["pixel_values"])
    assert one["video_grid_thw"].tolist() == pixels["image_grid_thw"].tolist()
    three = processor(videos=[[frame(1), frame(2), still]], size=SIZE, return_tensors="pt")
    assert three["video_grid_thw"][0, 0] == 2
    last_group = three["pixel_values_videos"][-pixels["pixel_values"].shape[0] :]
    assert torch.equal(last_group, pixels["pixel_values"])


def test_several_videos_concatenate_with_a_grid_each(images: Qwen2VLImageProcessorPil) -> None:
    processor = FrameProcessor(images)
    first, second = [frame(1), frame(2)], [frame(3, 120, 60)] * 4
    both = processor(videos=[first, second], size=SIZE, return_tensors="pt")
    alone = [processor(videos=[video], size=SIZE, return_tensors="pt") for video in (first, second)]
    assert both["video_grid_thw"].tolist() == [a["video_grid_thw"][0].tolist() for a in alone]
    assert torch.equal(both["pixel_values_videos"], torch.cat([a["pixel_values_videos"] for a in alone]))
