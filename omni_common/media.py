"""Input media as the client SDK sends them (GenerateRequest.inputs): images, audio clips and
videos from what a caller has at hand (a PIL image, samples, a path, file bytes, frames, an
animated GIF). No torch here."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageSequence

from omnistage.v1 import coordinator_pb2 as cpb

ImageLike = Image.Image | bytes | str | os.PathLike[str]
# A WAV, FLAC or MP3 file (its bytes or its path), or float samples in [-1, 1] with their rate.
AudioLike = bytes | str | os.PathLike[str] | tuple[np.ndarray, int]


def image_bytes(image: ImageLike) -> bytes:
    """An input image as encoded file bytes: a PIL image is sent as PNG (lossless), a path is
    read, bytes are sent as they are (the server checks them)."""
    if isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(image, bytes):
        return image
    with open(image, "rb") as file:
        return file.read()


def input_audio(audio: AudioLike) -> cpb.InputAudio:
    """An input clip: samples travel as raw float32 PCM at their rate, files as they are (FLAC
    or MP3 when they start like one, else WAV; the server checks them)."""
    if isinstance(audio, tuple):
        samples, rate = audio
        data = np.ascontiguousarray(samples, dtype="<f4").reshape(-1).tobytes()
        return cpb.InputAudio(data=data, format=cpb.AUDIO_INPUT_FORMAT_FLOAT32, sample_rate=int(rate))
    if not isinstance(audio, bytes):
        with open(audio, "rb") as file:
            audio = file.read()
    return cpb.InputAudio(data=audio, format=audio_file_format(audio))


def audio_file_format(data: bytes) -> cpb.AudioInputFormat:
    """An audio file's AudioInputFormat from its first bytes: FLAC's "fLaC", MP3's ID3v2 tag or
    frame sync (11 set bits), else WAV (which the server checks like any other)."""
    if data[:4] == b"fLaC":
        return cpb.AUDIO_INPUT_FORMAT_FLAC
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return cpb.AUDIO_INPUT_FORMAT_MP3
    return cpb.AUDIO_INPUT_FORMAT_WAV


# What an animated image's frames last when its file says 0 ms (or 10 ms): browsers show
# such GIFs at 10 frames a second.
DEFAULT_FRAME_MS = 100


@dataclass(frozen=True)
class Video:
    """A video as its frames (each an image: PIL, file bytes or a path) taken `fps` times a
    second. The server decodes no container: sample the frames you want seen (Qwen2.5-Omni was
    trained on 2 a second) and send them, or read an animated GIF with `Video.open`."""

    frames: Sequence[ImageLike]
    fps: float

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Video:
        """An animated image's frames (GIF, animated PNG or WebP: what PIL reads), each as RGB,
        at the rate its frames' durations average to (DEFAULT_FRAME_MS each where a file says
        0 or 10 ms, as browsers show them)."""
        with Image.open(path) as animation:
            frames: list[Image.Image] = []
            total_ms = 0.0
            for frame in ImageSequence.Iterator(animation):
                duration = float(frame.info.get("duration") or 0)
                total_ms += duration if duration > 10 else DEFAULT_FRAME_MS
                frames.append(frame.convert("RGB"))
        return cls(frames, 1000 * len(frames) / total_ms)

    def message(self) -> cpb.InputVideo:
        """The InputVideo: each frame as encoded bytes (PIL images as PNG), and the rate."""
        return cpb.InputVideo(frames=[image_bytes(frame) for frame in self.frames], fps=float(self.fps))


def input_media(
    audios: Sequence[AudioLike] = (), images: Sequence[ImageLike] = (), videos: Sequence[Video] = ()
) -> list[cpb.InputMedia]:
    """GenerateRequest.inputs: the clips, the images, then the videos (each kind counts its own
    indices)."""
    return [
        *(cpb.InputMedia(audio=input_audio(audio)) for audio in audios),
        *(cpb.InputMedia(image=image_bytes(image)) for image in images),
        *(cpb.InputMedia(video=video.message()) for video in videos),
    ]
