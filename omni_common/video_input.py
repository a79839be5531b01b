"""Input videos (InputVideo): a clip's frames, each an encoded image, and their rate, checked
and given to the stages as one canonical serialized InputVideo.

No container is decoded anywhere (no av, decord or torchcodec): a client sends the frames it
sampled. The coordinator re-serializes every video deterministically (`input.video.i`, whose
digest is the caches' content address wherever it is computed) and checks it at the edge from
its frames' headers (no pixels decoded). A stage checks it again (a stage may be called
directly) and decodes the frames only in the runner that uses them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from google.protobuf.message import DecodeError
from PIL import Image

from omni_common.errors import InvalidArgument
from omni_common.imaging import decode_image_file, inspect_image
from omni_common.input_media import INPUT_PREFIX, VideoInput, input_video_name
from omni_common.limits import MAX_VIDEO_FPS, MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS, MIN_VIDEO_FPS
from omnistage.v1 import coordinator_pb2 as cpb


def canonical_video(video: cpb.InputVideo) -> bytes:
    """The bytes the stages get for `video`: its frames and rate alone (no unknown fields),
    serialized deterministically. Unchecked: `inspect_video` checks them."""
    canonical = cpb.InputVideo(frames=video.frames, fps=video.fps)
    return canonical.SerializeToString(deterministic=True)


def inspect_video(data: bytes, *, index: int, max_pixels: int) -> VideoInput:
    """What planning needs of a canonical video (its frames, size, rate, content address), checked
    against the limits (`check_video`)."""
    video = parse_video(data, index=index)
    if canonical_video(video) != data:
        raise InvalidArgument(
            f"input video {index} is not a canonical InputVideo (send it through the coordinator)"
        )
    return check_video(video, index=index, max_pixels=max_pixels, digest=hashlib.sha256(data).hexdigest())


def parse_video(data: bytes, *, index: int) -> cpb.InputVideo:
    """A serialized InputVideo; INVALID_ARGUMENT for bytes that are not one."""
    try:
        return cpb.InputVideo.FromString(data)
    except DecodeError:
        raise InvalidArgument(f"input video {index} is not a serialized InputVideo") from None


def check_video(video: cpb.InputVideo, *, index: int, max_pixels: int, digest: str) -> VideoInput:
    """`video` as planning knows it, if it is within the limits: 1 to MAX_VIDEO_FRAMES frames,
    each a readable image of one size under `max_pixels`, MAX_VIDEO_PIXELS in all, fps in
    [MIN_VIDEO_FPS, MAX_VIDEO_FPS]; INVALID_ARGUMENT saying which limit it is over if not."""
    label = f"input video {index}"
    if not video.frames:
        raise InvalidArgument(f"{label} has no frames")
    if len(video.frames) > MAX_VIDEO_FRAMES:
        raise InvalidArgument(f"{label} has {len(video.frames)} frames; the limit is {MAX_VIDEO_FRAMES}")
    if not (math.isfinite(video.fps) and MIN_VIDEO_FPS <= video.fps <= MAX_VIDEO_FPS):
        raise InvalidArgument(
            f"{label} has fps {video.fps:g}; allowed: [{MIN_VIDEO_FPS:g}, {MAX_VIDEO_FPS:g}]"
        )
    first = inspect_image(video.frames[0], max_pixels=max_pixels, label=f"{label} frame 0")
    if len(video.frames) * first.width * first.height > MAX_VIDEO_PIXELS:
        raise InvalidArgument(
            f"{label} is {len(video.frames)} frames of {first.width}x{first.height} = "
            f"{len(video.frames) * first.width * first.height} pixels; the limit is {MAX_VIDEO_PIXELS}"
        )
    for j, frame in enumerate(video.frames[1:], start=1):
        seen = inspect_image(frame, max_pixels=max_pixels, label=f"{label} frame {j}")
        if (seen.width, seen.height) != (first.width, first.height):
            raise InvalidArgument(
                f"{label} frame {j} is {seen.width}x{seen.height}, frame 0 {first.width}x{first.height}: "
                "a video's frames must all be one size"
            )
    return VideoInput(len(video.frames), first.width, first.height, video.fps, digest)


def decode_video(data: bytes, *, index: int) -> tuple[list[Image.Image], float]:
    """A canonical video's frames as RGB PIL images, and its fps."""
    video = parse_video(data, index=index)
    frames = [
        decode_image_file(frame, label=f"input video {index} frame {j}")
        for j, frame in enumerate(video.frames)
    ]
    return frames, video.fps


def input_videos(tensors: Mapping[str, torch.Tensor], *, max_pixels: int) -> tuple[VideoInput, ...]:
    """The input videos among a stage call's tensors (`input.video.0`, `.1`, ...), checked."""
    found: list[VideoInput] = []
    while (tensor := tensors.get(input_video_name(len(found)))) is not None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise InvalidArgument(
                f"{input_video_name(len(found))} must be a 1-D uint8 tensor of InputVideo bytes"
            )
        found.append(inspect_video(video_bytes(tensor), index=len(found), max_pixels=max_pixels))
    extra = [name for name in tensors if name.startswith(INPUT_PREFIX + "video.")]
    if len(extra) != len(found):
        raise InvalidArgument("input videos must be numbered from 0 without gaps")
    return tuple(found)


def video_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().cpu().numpy().tobytes()
