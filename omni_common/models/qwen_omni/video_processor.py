"""Qwen2.5-Omni's video part: transformers' Qwen2-VL video processor's recipe run on the PIL
image processor's operations. Each frame is resized by `smart_resize` to the video's pixel range
(a multiple of patch x merge a side), rescaled and normalised, exactly as an image of its size;
the frames are grouped `temporal_patch_size` at a time (the last repeated to fill a group) and
cut into patches in the video processor's merge order: `pixel_values_videos` [grid_t * grid_h *
grid_w, C * temporal_patch_size * patch^2] and `video_grid_thw`, as `Qwen2VLVideoProcessor`
returns them.

Why not `Qwen2VLVideoProcessor` itself: transformers' video processors are torchvision ones
(`BaseVideoProcessor` requires it), and no torchvision wheel loads beside the CPU torch these
environments run (scripts/lock.sh). The image part is the PIL backend already (processor.py says
why), so a frame resizes as an image of its size does; torchvision's bicubic differs from PIL's
in the last bits, so features match this recipe, not torchvision's, to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from transformers import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class FrameProcessor:
    """The video processor of `OmniProcessor` (see the module docstring), with the image
    processor's settings: the published checkpoint keeps both parts' in one file, and the Omni
    processor passes each call the video pixel range (its `videos_kwargs` size)."""

    def __init__(self, images: Qwen2VLImageProcessorPil) -> None:
        self.model_input_names = ["pixel_values_videos", "video_grid_thw"]
        self.images = images
        self.patch_size: int = images.patch_size
        self.merge_size: int = images.merge_size
        self.temporal_patch_size: int = images.temporal_patch_size
        self.size: Mapping[str, int] = dict(images.size)

    def __call__(
        self,
        videos: Sequence[Sequence[Image.Image]],
        *,
        size: Mapping[str, int] | None = None,
        return_tensors: str | None = None,
        **_: Any,  # fps and the rest: frames are taken as sent (no sampling), so they change nothing
    ) -> BatchFeature:
        """Each video (its RGB frames, one size) as patches, all videos' concatenated, and a
        grid each."""
        patches, grids = [], []
        for frames in videos:
            video, grid = self.video(list(frames), dict(size or self.size))
            patches.append(video)
            grids.append(grid)
        return BatchFeature(
            {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids)},
            tensor_type=return_tensors,
        )

    def video(self, frames: list[Image.Image], size: dict[str, int]) -> tuple[torch.Tensor, list[int]]:
        """One video's patches and its (grid_t, grid_h, grid_w)."""
        # One patch of one frame per row: the image processor's rows with a temporal size of 1.
        out = self.images.preprocess(frames, size=size, temporal_patch_size=1, return_tensors="pt")
        pixels, (_, grid_h, grid_w) = out["pixel_values"], out["image_grid_thw"][0].tolist()
        m, p, t = self.merge_size, self.patch_size, self.temporal_patch_size
        channels = pixels.shape[-1] // (p * p)
        frame_patches = pixels.view(len(frames), grid_h // m, grid_w // m, m, m, channels, p, p)
        if pad := -len(frames) % t:  # the last frame repeated, as the video processor pads
            frame_patches = torch.cat(
                [frame_patches, frame_patches[-1:].expand(pad, *frame_patches.shape[1:])]
            )
        grid_t = frame_patches.shape[0] // t
        grouped = frame_patches.view(grid_t, t, *frame_patches.shape[1:]).permute(0, 2, 3, 4, 5, 6, 1, 7, 8)
        return grouped.reshape(grid_t * grid_h * grid_w, channels * t * p * p), [grid_t, grid_h, grid_w]
