"""A request's input media as the stages receive them: the tensor names their file bytes travel
under (`input.image.0`, `input.audio.0`, `input.video.0`, ...) and what validation and planning
know of each without decoding it. The ground of both the checks at the edge (imaging.py,
audio_input.py, video_input.py) and the family contract (models/base.py)."""

from __future__ import annotations

from dataclasses import dataclass

# Where a plan step reads the request's own inputs: "input.image.0", "input.image.1", ...
INPUT_PREFIX = "input."


def input_image_name(index: int) -> str:
    """The tensor name of the request's `index`-th input image (its encoded file bytes, uint8)."""
    return f"{INPUT_PREFIX}image.{index}"


def input_audio_name(index: int) -> str:
    """The tensor name of the request's `index`-th input audio clip (a WAV or FLAC file's bytes,
    uint8; raw PCM arrives at the stages wrapped as WAV)."""
    return f"{INPUT_PREFIX}audio.{index}"


def input_video_name(index: int) -> str:
    """The tensor name of the request's `index`-th input video (a serialized InputVideo: its
    frames' encoded image files and their rate, uint8)."""
    return f"{INPUT_PREFIX}video.{index}"


@dataclass(frozen=True)
class AudioInput:
    """What validation and planning know of an input audio clip once decoded."""

    sample_rate: int
    frames: int  # samples per channel
    digest: str  # sha256 of the file bytes the stages get, hex: the content address of caches

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


@dataclass(frozen=True)
class ImageInput:
    """What validation and planning know of an input image without decoding its pixels."""

    width: int
    height: int
    format: str  # PIL's name: "PNG", "JPEG", ...
    digest: str  # sha256 of the encoded bytes, hex: the content address of caches


@dataclass(frozen=True)
class VideoInput:
    """What validation and planning know of an input video from its frames' headers."""

    frames: int
    width: int  # every frame's
    height: int
    fps: float
    digest: str  # sha256 of the serialized InputVideo the stages get, hex: the caches' address

    @property
    def seconds(self) -> float:
        return self.frames / self.fps
