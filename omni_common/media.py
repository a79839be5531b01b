"""Input media as the client SDK sends them (GenerateRequest.inputs): images and audio clips
from what a caller has at hand (a PIL image, samples, a path, file bytes). No torch here."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

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


def input_media(audios: Sequence[AudioLike] = (), images: Sequence[ImageLike] = ()) -> list[cpb.InputMedia]:
    """GenerateRequest.inputs: the clips, then the images (each kind counts its own indices)."""
    return [
        *(cpb.InputMedia(audio=input_audio(audio)) for audio in audios),
        *(cpb.InputMedia(image=image_bytes(image)) for image in images),
    ]
