"""Audio samples on the wire and on disk: AudioChunk encodings (PCM16, float32) and WAV files.

Mono, little-endian. PCM16 is what players and browsers take; float32 keeps the model's own
samples (what parity tests compare).
"""

from __future__ import annotations

import wave
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from omnistage.v1 import coordinator_pb2 as cpb

if TYPE_CHECKING:  # the client SDK (decode, WAV files) works without torch
    import torch

PCM16_SCALE = 32767


def encode_audio(samples: torch.Tensor, audio_format: int) -> bytes:
    """Float samples in [-1, 1] (any shape, read flat) as AudioChunk.data bytes."""
    import torch

    flat = samples.detach().to("cpu", torch.float32).reshape(-1).numpy()
    if audio_format == cpb.AUDIO_FORMAT_FLOAT32:
        return flat.astype("<f4").tobytes()
    return to_pcm16(flat).tobytes()


def decode_audio(data: bytes, audio_format: int) -> np.ndarray:
    """AudioChunk.data as float32 samples (PCM16 scaled back to [-1, 1])."""
    if audio_format == cpb.AUDIO_FORMAT_FLOAT32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / PCM16_SCALE


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples -> int16: round(clamp(x, -1, 1) * 32767)."""
    return np.round(np.clip(samples, -1.0, 1.0) * PCM16_SCALE).astype("<i2")


def write_wav(path: Path, samples: np.ndarray, sample_rate: int) -> None:
    """A mono 16-bit WAV file of float samples in [-1, 1]."""
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(to_pcm16(samples).tobytes())
