"""Input audio clips: WAV of every supported sample format decodes to the same float samples,
raw PCM is wrapped as WAV of the same samples, FLAC decodes exactly and MP3 is wrapped as a WAV
of what libsndfile decodes it to, and what is not audio, is empty or too long (FLAC and MP3
before they are all decoded), or states a rate that disagrees with its file is
INVALID_ARGUMENT with a message saying so."""

from __future__ import annotations

import struct
import wave
from io import BytesIO

import numpy as np
import pytest
import soundfile

from omni_common.audio_input import (
    MAX_AUDIO_SECONDS,
    canonical_audio,
    decode_audio_file,
    inspect_audio,
    wav_bytes,
)
from omni_common.errors import InvalidArgument
from omni_common.media import audio_file_format
from omnistage.v1 import coordinator_pb2 as cpb


def stdlib_wav(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    """Integer PCM written by the standard library's `wave` (not by the code under test)."""
    out = BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(samples.dtype.itemsize)
        file.setframerate(rate)
        file.writeframes(samples.tobytes())
    return out.getvalue()


def test_16_bit_wav_decodes_to_samples_over_32768() -> None:
    ints = np.array([0, 1, -1, 32767, -32768], dtype="<i2")
    samples, rate = decode_audio_file(stdlib_wav(ints, 16_000))
    assert rate == 16_000
    np.testing.assert_array_equal(samples, ints.astype(np.float32) / 32768)


def test_8_24_32_bit_and_float_wav_agree() -> None:
    base = np.array([0.0, 0.5, -0.5, 0.25], dtype=np.float64)
    eight = stdlib_wav((base * 128 + 128).astype(np.uint8), 8000)
    int32 = stdlib_wav((base * 2**31).astype("<i4"), 8000)
    raw24 = b"".join(struct.pack("<i", int(v * 2**23))[:3] for v in base)
    out = BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(3)
        file.setframerate(8000)
        file.writeframes(raw24)
    floats = wav_bytes(base.astype(np.float32), 8000)
    for data in (eight, int32, out.getvalue(), floats):
        np.testing.assert_array_equal(decode_audio_file(data)[0], base.astype(np.float32))


def test_stereo_is_averaged_to_mono() -> None:
    ints = np.array([[1000, 3000], [-2000, 0]], dtype="<i2")
    samples, _ = decode_audio_file(stdlib_wav(ints.reshape(-1), 16_000, channels=2))
    np.testing.assert_array_equal(samples, np.array([2000, -1000], np.float32) / 32768)


def test_raw_pcm_is_wrapped_as_a_wav_of_the_same_samples() -> None:
    pcm = np.array([0.1, -0.2, 0.3], dtype="<f4")
    clip = cpb.InputAudio(data=pcm.tobytes(), format=cpb.AUDIO_INPUT_FORMAT_FLOAT32, sample_rate=16_000)
    samples, rate = decode_audio_file(canonical_audio(clip, index=0))
    assert rate == 16_000
    np.testing.assert_array_equal(samples, pcm)
    ints = np.array([5, -7], dtype="<i2")
    clip = cpb.InputAudio(data=ints.tobytes(), format=cpb.AUDIO_INPUT_FORMAT_PCM16, sample_rate=8000)
    assert inspect_audio(canonical_audio(clip, index=0), index=0).frames == 2


@pytest.mark.parametrize(
    ("clip", "message"),
    [
        (cpb.InputAudio(data=b"GIF89a not audio"), "not a WAV or FLAC file"),
        (cpb.InputAudio(data=wav_bytes(np.zeros(0, np.int16), 16_000)), "no samples (0 s)"),
        (
            cpb.InputAudio(data=wav_bytes(np.zeros(1001 * 1000, np.int16), 1000)),
            f"at most {MAX_AUDIO_SECONDS} s",
        ),
        (cpb.InputAudio(data=b"\0\0", format=cpb.AUDIO_INPUT_FORMAT_PCM16), "raw PCM needs sample_rate"),
        (
            cpb.InputAudio(data=b"\0\0\0", format=cpb.AUDIO_INPUT_FORMAT_PCM16, sample_rate=8000),
            "whole samples",
        ),
        (cpb.InputAudio(data=wav_bytes(np.zeros(8, np.int16), 8000), sample_rate=16_000), "the file 8000 Hz"),
        (cpb.InputAudio(data=wav_bytes(np.array([np.nan], np.float32), 8000)), "not finite"),
        (cpb.InputAudio(data=b"RIFF\0\0\0\0WAVEjunk"), "without fmt and data"),
    ],
    ids=[
        "not-audio",
        "zero-seconds",
        "too-long",
        "pcm-no-rate",
        "pcm-half-sample",
        "rate-mismatch",
        "nan",
        "no-chunks",
    ],
)
def test_bad_clips_are_invalid_argument(clip: cpb.InputAudio, message: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        canonical_audio(clip, index=0)
    assert message in raised.value.message


def test_an_hour_of_audio_is_refused() -> None:
    hour = wav_bytes(np.zeros(3600 * 1000, np.int16), 1000)
    with pytest.raises(InvalidArgument, match=r"lasts 3600\.0 s"):
        decode_audio_file(hour)


def encoded(samples: np.ndarray, rate: int, kind: str) -> bytes:
    """`samples` (int16) as a FLAC or MP3 file, written by libsndfile."""
    out = BytesIO()
    soundfile.write(out, samples, rate, format=kind)
    return out.getvalue()


def test_flac_decodes_exactly_and_mp3_becomes_a_wav_of_its_decoded_samples() -> None:
    ints = (np.sin(np.arange(16_000) * 0.03) * 20_000).astype("<i2")
    flac = encoded(ints, 16_000, "FLAC")
    assert audio_file_format(flac) == cpb.AUDIO_INPUT_FORMAT_FLAC
    np.testing.assert_array_equal(decode_audio_file(flac)[0], ints.astype(np.float32) / 32768)
    mp3 = encoded(ints, 16_000, "MP3")
    assert audio_file_format(mp3) == cpb.AUDIO_INPUT_FORMAT_MP3
    canonical = canonical_audio(cpb.InputAudio(data=mp3, format=cpb.AUDIO_INPUT_FORMAT_MP3), index=0)
    samples, rate = decode_audio_file(canonical)  # what the stages read: a WAV
    assert canonical[:4] == b"RIFF" and rate == 16_000
    # (libsndfile's mpg123 output moves by an ulp after a seek, which soundfile.read makes)
    np.testing.assert_allclose(samples, soundfile.read(BytesIO(mp3), dtype="float32")[0], rtol=0, atol=1e-6)
    assert canonical == canonical_audio(cpb.InputAudio(data=mp3, format=cpb.AUDIO_INPUT_FORMAT_MP3), index=0)


@pytest.mark.parametrize("kind", ["FLAC", "MP3"])
def test_long_flac_and_mp3_are_refused(kind: str) -> None:
    silence = encoded(np.zeros((MAX_AUDIO_SECONDS + 1) * 8000, np.int16), 8000, kind)
    fmt = cpb.AUDIO_INPUT_FORMAT_FLAC if kind == "FLAC" else cpb.AUDIO_INPUT_FORMAT_MP3
    with pytest.raises(InvalidArgument, match=f"lasts over {MAX_AUDIO_SECONDS} s"):
        canonical_audio(cpb.InputAudio(data=silence, format=fmt), index=0)


def test_a_wav_sent_as_mp3_is_refused() -> None:
    wav = wav_bytes(np.zeros(8, np.int16), 8000)
    with pytest.raises(InvalidArgument, match="not a MP3 file"):
        canonical_audio(cpb.InputAudio(data=wav, format=cpb.AUDIO_INPUT_FORMAT_MP3), index=0)
