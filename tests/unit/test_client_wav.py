"""WAV files on the client side: read as mono int16, resampled to a rate the server takes."""

from __future__ import annotations

import numpy as np
from rtmedia.clients.audio_file import Audio, read_audio, write_audio


def test_at_rate_resamples_and_keeps_the_tone(tmp_path) -> None:
    t = np.arange(44100) / 44100
    tone = (np.sin(2 * np.pi * 440 * t) * 10000).astype(np.int16)
    path = tmp_path / "tone.wav"
    write_audio(path, tone.tobytes(), 44100)
    audio = read_audio(path)
    assert audio.sample_rate == 44100 and np.array_equal(audio.samples, tone)
    same = audio.at_rate(44100)
    assert same is audio
    down = audio.at_rate(16000)
    assert down.sample_rate == 16000 and down.samples.dtype == np.int16 and abs(len(down.samples) - 16000) <= 1
    rms = float(np.sqrt(np.mean(down.samples[1000:-1000].astype(np.float64) ** 2)))
    assert abs(rms / (10000 / np.sqrt(2)) - 1) < 0.02, rms
    spectrum = np.abs(np.fft.rfft(down.samples[:16000].astype(np.float64)))
    assert abs(int(spectrum.argmax()) - 440) <= 1


def test_empty_audio_resamples_to_empty() -> None:
    assert len(Audio(np.zeros(0, np.int16), 48000).at_rate(16000).samples) == 0
