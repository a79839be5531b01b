"""Input audio clips (InputAudio): decoded to float32 mono samples, checked, and given to the
stages as one canonical file.

The coordinator decodes every clip at the edge (a clip that is not audio, has no samples or is
longer than `MAX_AUDIO_SECONDS` is INVALID_ARGUMENT there, before any stage runs) and hands the
stages a WAV or FLAC file: raw PCM and MP3 are wrapped into a WAV of their samples (MP3 is
decoded once, here, so no stage depends on its decoder), so a stage reads one self-describing
format and the rate travels with the bytes. The stages decode it again with the same code (a
stage may be called directly), so both sides see the same samples. FLAC and MP3 are read by
libsndfile (the soundfile package), a block at a time, so a file that would decode to more
than the limit is refused before it is all in memory.

Integer PCM maps to [-1, 1) by dividing by 2^(bits-1) (soundfile's and librosa's convention);
several channels are averaged to mono (librosa's `mono=True`). Nothing is resampled: a family
that needs one rate refuses others (family.validate).
"""

from __future__ import annotations

import hashlib
import io
import struct
from collections.abc import Mapping

import numpy as np
import soundfile
import torch

from omni_common.errors import InvalidArgument
from omni_common.input_media import INPUT_PREFIX, AudioInput, input_audio_name
from omnistage.v1 import coordinator_pb2 as cpb

MAX_AUDIO_SECONDS = 600  # the server's limit on one clip, whatever the model takes
MIN_RATE, MAX_RATE = 1_000, 384_000
WAVE_PCM, WAVE_FLOAT, WAVE_EXTENSIBLE = 1, 3, 0xFFFE
RAW_FORMATS = {cpb.AUDIO_INPUT_FORMAT_PCM16: "<i2", cpb.AUDIO_INPUT_FORMAT_FLOAT32: "<f4"}
READ_BLOCK = 1 << 16  # frames libsndfile decodes at a time


def canonical_audio(clip: cpb.InputAudio, *, index: int) -> bytes:
    """The file the stages get for `clip` (raw PCM wrapped as WAV, files as sent), after
    checking that it decodes to a clip within the limits."""
    if clip.format in RAW_FORMATS:
        if not MIN_RATE <= clip.sample_rate <= MAX_RATE:
            raise InvalidArgument(
                f"input audio {index}: raw PCM needs sample_rate in [{MIN_RATE}, {MAX_RATE}] Hz; "
                f"got {clip.sample_rate}"
            )
        width = np.dtype(RAW_FORMATS[clip.format]).itemsize
        if len(clip.data) % width:
            raise InvalidArgument(
                f"input audio {index}: raw PCM of {len(clip.data)} bytes is not whole samples"
            )
        samples = np.frombuffer(clip.data, dtype=RAW_FORMATS[clip.format])
        data = wav_bytes(samples, clip.sample_rate)
    elif clip.format in (cpb.AUDIO_INPUT_FORMAT_WAV, cpb.AUDIO_INPUT_FORMAT_FLAC):
        data = clip.data
    elif clip.format == cpb.AUDIO_INPUT_FORMAT_MP3:
        samples, rate = _checked(*_decode_soundfile(clip.data, index, "MP3"), index)
        data = wav_bytes(samples, rate)
    else:
        raise InvalidArgument(f"input audio {index}: unknown format {clip.format}")
    _, rate = decode_audio_file(data, index=index)
    if clip.sample_rate and clip.format not in RAW_FORMATS and clip.sample_rate != rate:
        raise InvalidArgument(
            f"input audio {index}: sample_rate says {clip.sample_rate} Hz, the file {rate} Hz"
        )
    return data


def inspect_audio(data: bytes, *, index: int) -> AudioInput:
    """What planning needs of a canonical clip (its rate, length and content address), checked."""
    samples, rate = decode_audio_file(data, index=index)
    return AudioInput(rate, len(samples), hashlib.sha256(data).hexdigest())


def decode_audio_file(data: bytes, *, index: int = 0) -> tuple[np.ndarray, int]:
    """A WAV or FLAC file as float32 mono samples and its rate; INVALID_ARGUMENT for anything
    else, an empty clip or one over MAX_AUDIO_SECONDS."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        samples, rate = _decode_wav(data, index)
    elif data[:4] == b"fLaC":
        samples, rate = _decode_soundfile(data, index, "FLAC")
    else:
        raise InvalidArgument(f"input audio {index} is not a WAV or FLAC file")
    return _checked(samples, rate, index)


def _checked(samples: np.ndarray, rate: int, index: int) -> tuple[np.ndarray, int]:
    """`samples` and `rate` if they are a clip within the limits; INVALID_ARGUMENT if not."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise InvalidArgument(
            f"input audio {index} has a sample rate of {rate} Hz; allowed: [{MIN_RATE}, {MAX_RATE}]"
        )
    if samples.size == 0:
        raise InvalidArgument(f"input audio {index} has no samples (0 s)")
    if samples.size > MAX_AUDIO_SECONDS * rate:
        raise InvalidArgument(
            f"input audio {index} lasts {samples.size / rate:.1f} s; "
            f"this server takes at most {MAX_AUDIO_SECONDS} s"
        )
    if not np.isfinite(samples).all():
        raise InvalidArgument(f"input audio {index} has samples that are not finite")
    return samples, rate


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A mono WAV file of `samples` as they are: int16 as 16-bit PCM, float32 as 32-bit float."""
    data = np.ascontiguousarray(samples)
    kind = WAVE_FLOAT if data.dtype.kind == "f" else WAVE_PCM
    width = data.dtype.itemsize
    body = data.astype(data.dtype.newbyteorder("<")).tobytes()
    fmt = struct.pack("<HHIIHH", kind, 1, rate, rate * width, width, 8 * width)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def _decode_wav(data: bytes, index: int) -> tuple[np.ndarray, int]:
    """RIFF chunks read by hand: the stdlib's `wave` takes integer PCM only, not float."""
    fmt: tuple[int, int, int, int] | None = None
    body: bytes | None = None
    offset = 12
    while offset + 8 <= len(data):
        name, size = data[offset : offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        chunk = data[offset + 8 : offset + 8 + size]
        if name == b"fmt " and len(chunk) >= 16:
            kind, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", chunk)
            if kind == WAVE_EXTENSIBLE and len(chunk) >= 26:
                kind = struct.unpack_from("<H", chunk, 24)[0]  # the sub-format GUID's first field
            fmt = (kind, channels, rate, bits)
        elif name == b"data":
            body = chunk
            break
        offset += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None or body is None:
        raise InvalidArgument(f"input audio {index}: a WAV file without fmt and data chunks")
    kind, channels, rate, bits = fmt
    dtypes = {(WAVE_PCM, 8): "u1", (WAVE_PCM, 16): "<i2", (WAVE_PCM, 32): "<i4", (WAVE_FLOAT, 32): "<f4"}
    if channels < 1 or ((kind, bits) not in dtypes and (kind, bits) != (WAVE_PCM, 24)):
        raise InvalidArgument(
            f"input audio {index}: WAV of format {kind}, {bits} bits, {channels} channels is not supported "
            "(8/16/24/32-bit integer PCM or 32-bit float)"
        )
    frame = channels * bits // 8
    body = body[: len(body) - len(body) % frame]
    if (kind, bits) == (WAVE_PCM, 24):  # widen 3-byte samples to int32 (top bytes), then scale
        raw = np.frombuffer(body, dtype=np.uint8).reshape(-1, 3)
        wide = np.zeros((raw.shape[0], 4), dtype=np.uint8)
        wide[:, 1:] = raw
        values = wide.view("<i4").reshape(-1).astype(np.float64) / 2**31
    else:
        values = np.frombuffer(body, dtype=dtypes[kind, bits]).astype(np.float64)
        if kind == WAVE_PCM:
            values = (values - 128) / 128 if bits == 8 else values / 2 ** (bits - 1)
    return values.reshape(-1, channels).mean(axis=1).astype(np.float32), rate


def _decode_soundfile(data: bytes, index: int, kind: str) -> tuple[np.ndarray, int]:
    """A FLAC or MP3 file (`kind`, libsndfile's name) as float32 mono samples and its rate, read
    a block at a time: more than MAX_AUDIO_SECONDS is refused before it is all decoded (a few
    MiB of FLAC silence or of 8 kbps MP3 would otherwise decode to GiBs)."""
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as file:
            if file.format != kind:
                raise InvalidArgument(f"input audio {index} is not a {kind} file")
            rate, limit = file.samplerate, MAX_AUDIO_SECONDS * file.samplerate
            blocks: list[np.ndarray] = []
            frames = 0
            while len(block := file.read(READ_BLOCK, dtype="float32", always_2d=True)):
                blocks.append(block.mean(axis=1, dtype=np.float32))
                frames += len(block)
                if frames > limit:
                    raise InvalidArgument(
                        f"input audio {index} lasts over {MAX_AUDIO_SECONDS} s; "
                        f"this server takes at most {MAX_AUDIO_SECONDS} s"
                    )
    except (RuntimeError, ValueError) as err:  # LibsndfileError is a RuntimeError
        raise InvalidArgument(
            f"input audio {index}: the {kind} file does not decode ({type(err).__name__})"
        ) from None
    return (np.concatenate(blocks) if blocks else np.zeros(0, np.float32)), int(rate)


def input_audios(tensors: Mapping[str, torch.Tensor]) -> tuple[AudioInput, ...]:
    """The input audio clips among a stage call's tensors (`input.audio.0`, `.1`, ...), checked."""
    found: list[AudioInput] = []
    while (tensor := tensors.get(input_audio_name(len(found)))) is not None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise InvalidArgument(f"{input_audio_name(len(found))} must be a 1-D uint8 tensor of file bytes")
        found.append(inspect_audio(audio_file_bytes(tensor), index=len(found)))
    extra = [name for name in tensors if name.startswith(INPUT_PREFIX + "audio.")]
    if len(extra) != len(found):
        raise InvalidArgument("input audio clips must be numbered from 0 without gaps")
    return tuple(found)


def audio_file_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().cpu().numpy().tobytes()
