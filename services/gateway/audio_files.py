"""The gateway's audio replies as files of OpenAI's formats: WAV, raw PCM, FLAC and MP3, from
the coordinator's PCM16 chunks (mono, little-endian), whole or as they stream.

- wav: a 16-bit header, then the samples as they come (a streamed header says "to the end").
- pcm: the samples as they come.
- mp3: encoded as the chunks come (LAME inside libsndfile, constant bit rate): each chunk's
  frames go out as soon as the encoder has them. A streamed MP3 has no LAME info frame (that
  frame holds the length and is written when the encoder closes, so it cannot lead a stream):
  a decoder then plays the encoder's delay (1,105 samples at 24 kHz, 46 ms of near silence)
  before the speech and pads the end to a whole frame, as with any streamed MP3. A whole MP3
  (a chat reply's `message.audio.data`) has the info frame, and decodes to the samples alone.
- flac: encoded when the reply is complete, and sent then. A FLAC file's header holds its
  length and checksum, written when the encoder closes; libsndfile (soundfile) cannot read a
  FLAC file streamed without them to its end. Lossless: it decodes to the PCM16 samples exactly.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct

import numpy as np
import soundfile

MP3 = {"format": "MP3", "subtype": "MPEG_LAYER_III", "bitrate_mode": "CONSTANT"}
# libsndfile's 0 (best) to 1 (smallest): 0.4 is 96 kbps at 16-24 kHz (MPEG-2), 192 kbps at
# 32-48 kHz.
MP3_COMPRESSION = 0.4
# Samples given to the MP3 encoder before its output is read: at most ~0.4 s, whose frames
# (<= 20 KiB at the highest bit rate) fit the pipe's 64 KiB buffer, so a write never blocks.
MP3_SLICE = 1 << 14


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 16-bit mono WAV header; `data_bytes` None (a streamed body, its length unknown) writes
    the largest sizes, which players read as "until the end of the stream"."""
    size = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", size)


def whole_file(pcm: bytes, sample_rate: int, response_format: str) -> bytes:
    """A whole reply's PCM16 samples as one file of `response_format` (wav, pcm, flac, mp3)."""
    if response_format == "pcm":
        return pcm
    if response_format == "wav":
        return wav_header(sample_rate, len(pcm)) + pcm
    out = io.BytesIO()
    kind = {"format": "FLAC", "subtype": "PCM_16"} if response_format == "flac" else MP3
    extra = {"compression_level": MP3_COMPRESSION} if response_format == "mp3" else {}
    with soundfile.SoundFile(out, "w", samplerate=sample_rate, channels=1, **kind, **extra) as file:
        file.write(np.frombuffer(pcm, "<i2"))
    return out.getvalue()


class StreamedFile:
    """One reply's body in `response_format` as its PCM16 chunks come: send `start()`, `feed`
    each chunk and send what it returns, then send `finish()`. A context manager: leaving it
    frees the encoder (a reply cut short included)."""

    def __init__(self, response_format: str, sample_rate: int) -> None:
        self.format = response_format
        self.sample_rate = sample_rate
        self.held = bytearray()  # flac: the samples until the end
        self.mp3: Mp3Encoder | None = Mp3Encoder(sample_rate) if response_format == "mp3" else None

    def start(self) -> bytes:
        return wav_header(self.sample_rate) if self.format == "wav" else b""

    def feed(self, pcm: bytes) -> bytes:
        if self.mp3 is not None:
            return self.mp3.feed(pcm)
        if self.format == "flac":
            self.held += pcm
            return b""
        return pcm

    def finish(self) -> bytes:
        if self.mp3 is not None:
            return self.mp3.finish()
        if self.format == "flac":
            return whole_file(bytes(self.held), self.sample_rate, "flac")
        return b""

    def close(self) -> None:
        if self.mp3 is not None:
            self.mp3.close()

    def __enter__(self) -> StreamedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mp3Encoder:
    """LAME through libsndfile, writing into a pipe whose other end is read after each slice of
    samples. On a pipe libsndfile leaves out the info frame it would seek back to fill in, so
    every byte written is final and can be sent at once (a BytesIO would get a placeholder
    frame first, rewritten at the end)."""

    def __init__(self, sample_rate: int) -> None:
        self.reader, writer = os.pipe()
        os.set_blocking(self.reader, False)
        try:
            self.file: soundfile.SoundFile | None = soundfile.SoundFile(
                writer, "w", samplerate=sample_rate, channels=1, compression_level=MP3_COMPRESSION, **MP3
            )
        except Exception:
            os.close(writer)
            os.close(self.reader)
            raise

    def feed(self, pcm: bytes) -> bytes:
        assert self.file is not None
        samples = np.frombuffer(pcm, "<i2")
        out = bytearray()
        for start in range(0, len(samples), MP3_SLICE):
            self.file.write(samples[start : start + MP3_SLICE])
            out += self._drain()
        return bytes(out)

    def finish(self) -> bytes:
        """The last frames (LAME's buffered samples, padded to a frame)."""
        if self.file is not None:
            self.file.close()  # flushes LAME, then closes the pipe's writing end
            self.file = None
        return self._drain()

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.file.close()
            self.file = None
        if self.reader >= 0:
            os.close(self.reader)
            self.reader = -1

    def _drain(self) -> bytes:
        out = bytearray()
        while True:
            try:
                data = os.read(self.reader, 1 << 16)
            except BlockingIOError:
                break
            if not data:  # the writing end is closed and all was read
                break
            out += data
        return bytes(out)
