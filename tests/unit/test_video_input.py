"""Input videos: the stages get the frames and rate re-serialized the same way whatever the
caller's encoding of the message, decoded as the frames sent; a stage refuses bytes that are not
a canonical InputVideo, and numbering gaps; an animated GIF opens as its frames at the rate its
durations give."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_common.errors import InvalidArgument
from omni_common.input_media import input_video_name
from omni_common.media import Video
from omni_common.video_input import canonical_video, decode_video, input_videos, inspect_video
from omnistage.v1 import coordinator_pb2 as cpb

MAX_PIXELS = 1 << 22


def png(seed: int, width: int = 28, height: int = 28) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_a_video_reaches_the_stages_as_its_frames_and_rate() -> None:
    frames = [png(1), png(2), png(3)]
    data = canonical_video(cpb.InputVideo(frames=frames, fps=2.5))
    seen = inspect_video(data, index=0, max_pixels=MAX_PIXELS)
    assert (seen.frames, seen.width, seen.height, seen.fps, seen.seconds) == (3, 28, 28, 2.5, 1.2)
    decoded, fps = decode_video(data, index=0)
    assert fps == 2.5
    for image, frame in zip(decoded, frames, strict=True):
        assert image.tobytes() == Image.open(io.BytesIO(frame)).convert("RGB").tobytes()


def test_unknown_fields_do_not_change_the_bytes_or_the_digest() -> None:
    video = cpb.InputVideo(frames=[png(1)], fps=2.0)
    extended = video.SerializeToString() + b"\x18\x07"  # field 3, a varint no schema names
    plain = canonical_video(video)
    assert canonical_video(cpb.InputVideo.FromString(extended)) == plain


def test_a_stage_refuses_what_is_not_a_canonical_video_and_gaps() -> None:
    data = canonical_video(cpb.InputVideo(frames=[png(1)], fps=2.0))
    with pytest.raises(InvalidArgument, match="not a serialized InputVideo"):
        input_videos({input_video_name(0): tensor(b"\xff\xff\xff")}, max_pixels=MAX_PIXELS)
    with pytest.raises(InvalidArgument, match="not a canonical InputVideo"):
        input_videos({input_video_name(0): tensor(data + b"\x18\x07")}, max_pixels=MAX_PIXELS)
    with pytest.raises(InvalidArgument, match="numbered from 0 without gaps"):
        input_videos({input_video_name(1): tensor(data)}, max_pixels=MAX_PIXELS)
    with pytest.raises(InvalidArgument, match="1-D uint8"):
        input_videos({input_video_name(0): torch.zeros(3)}, max_pixels=MAX_PIXELS)
    assert len(input_videos({input_video_name(0): tensor(data)}, max_pixels=MAX_PIXELS)) == 1


def test_an_animated_gif_opens_as_its_frames_at_the_rate_of_its_durations(tmp_path: Path) -> None:
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    images = [Image.new("RGB", (16, 8), color) for color in colors]
    path = tmp_path / "clip.gif"
    images[0].save(path, save_all=True, append_images=images[1:], duration=250, loop=0)
    video = Video.open(path)
    assert video.fps == 4.0
    assert [frame.getpixel((0, 0)) for frame in video.frames] == colors  # type: ignore[union-attr]
    message = video.message()
    assert message.fps == 4.0 and len(message.frames) == 4


def test_a_gif_without_durations_plays_at_ten_frames_a_second(tmp_path: Path) -> None:
    images = [Image.new("RGB", (8, 8), (i * 60, 0, 0)) for i in range(3)]
    path = tmp_path / "fast.gif"
    images[0].save(path, save_all=True, append_images=images[1:], duration=0, loop=0)
    assert Video.open(path).fps == 10.0
