"""The gateway's audio files, decoded by libsndfile (soundfile) as a client would: FLAC is the
PCM16 samples exactly; MP3 keeps a tone within its codec's error, whole or streamed (a
perceptual codec: about 26 dB SNR measured here at 96 kbps; over 20 dB asserted), and a
streamed MP3's frames come out while the reply is still being fed; an encoder left mid-reply
frees its pipe."""

from __future__ import annotations

import io
import os

import numpy as np
import soundfile

from services.gateway.audio_files import StreamedFile, whole_file

RATE = 24_000
MP3_FRAME = 576  # samples of one MPEG-2 layer III frame (16-24 kHz)


def tone(seconds: float = 2.0) -> np.ndarray:
    """PCM16 samples of a speech-band tone that rises and falls."""
    t = np.arange(int(RATE * seconds)) / RATE
    wave = 0.5 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t) * np.sin(2 * np.pi * 3 * t)
    return np.round(wave * 32767).astype("<i2")


def decoded(data: bytes) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE
    return samples


def snr_db(heard: np.ndarray, sent: np.ndarray) -> float:
    """Signal to error of `heard` against `sent`, over the samples both have."""
    n = min(len(heard), len(sent))
    signal, error = sent[:n].astype(np.float64), heard[:n].astype(np.float64) - sent[:n]
    return float(10 * np.log10((signal**2).sum() / max((error**2).sum(), 1e-9)))


def test_flac_is_the_pcm16_samples_exactly() -> None:
    sent = tone()
    np.testing.assert_array_equal(decoded(whole_file(sent.tobytes(), RATE, "flac")), sent)
    with StreamedFile("flac", RATE) as out:
        body = out.start() + out.feed(sent[:1000].tobytes()) + out.feed(sent[1000:].tobytes())
        body += out.finish()
    np.testing.assert_array_equal(decoded(body), sent)


def test_a_whole_mp3_decodes_to_the_samples_within_the_codecs_error() -> None:
    sent = tone()
    heard = decoded(whole_file(sent.tobytes(), RATE, "mp3"))
    assert len(heard) == len(sent)  # the info frame says the encoder's delay and padding
    assert snr_db(heard, sent) > 20


def test_a_streamed_mp3_sends_frames_as_it_is_fed_and_decodes_after_the_encoders_delay() -> None:
    sent = tone()
    pieces = []
    with StreamedFile("mp3", RATE) as out:
        for start in range(0, len(sent), 4800):  # 0.2 s chunks, as the coordinator sends them
            pieces.append(out.feed(sent[start : start + 4800].tobytes()))
        last = out.finish()
    assert all(pieces[1:]), "every chunk after the first yields frames at once"
    heard = decoded(b"".join(pieces) + last)
    # No info frame in a stream: the decoder plays the encoder's delay first, then the tone.
    delay = max(range(0, 4 * MP3_FRAME), key=lambda lag: snr_db(heard[lag:], sent))
    assert delay < 2 * MP3_FRAME
    assert snr_db(heard[delay:], sent) > 20
    assert len(heard) - delay >= len(sent)


def test_an_mp3_left_mid_reply_closes_its_pipe() -> None:
    before = len(os.listdir("/proc/self/fd"))
    with StreamedFile("mp3", RATE) as out:
        out.feed(tone(0.5).tobytes())
        assert len(os.listdir("/proc/self/fd")) == before + 2  # the pipe's two ends
    assert len(os.listdir("/proc/self/fd")) == before
