"""The Python client library: thin, typed wrappers over the generated stubs."""

from __future__ import annotations

import wave
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from rtmedia.clients.credentials import Credentials
from rtmedia.v1 import common_pb2, realtime_pb2, speech_pb2, speech_pb2_grpc
from rtmedia.v1.realtime_pb2_grpc import RealtimeServiceStub

DEFAULT_TARGET = "127.0.0.1:50051"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
]


class SpeechClient:
    """SpeechService over one channel (plaintext without a token unless `credentials` say otherwise)."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None,
                 credentials: Credentials | None = None) -> None:
        self.channel = (credentials or Credentials()).channel(target, CHANNEL_OPTIONS)
        self.stub = speech_pb2_grpc.SpeechServiceStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpeechClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_voices(self) -> speech_pb2.ListVoicesResponse:
        return self.stub.ListVoices(speech_pb2.ListVoicesRequest(), timeout=self.timeout)

    def synthesize(self, text: str, voice: str = "", sample_rate: int = 0,
                   framing: int = speech_pb2.AUDIO_FRAMING_PCM16) -> Iterator[speech_pb2.SynthesizeResponse]:
        request = speech_pb2.SynthesizeRequest(text=text, voice=voice, sample_rate=sample_rate, framing=framing)
        return self.stub.Synthesize(request, timeout=self.timeout)

    def transcribe(self, chunks: Iterable[bytes], sample_rate: int,
                   encoding: int = common_pb2.AUDIO_ENCODING_PCM16,
                   partial_results: bool = True) -> Iterator[speech_pb2.TranscribeResponse]:
        def requests() -> Iterator[speech_pb2.TranscribeRequest]:
            fmt = common_pb2.AudioFormat(encoding=encoding, sample_rate=sample_rate, channels=1)
            yield speech_pb2.TranscribeRequest(
                config=speech_pb2.TranscribeConfig(audio_format=fmt, disable_partial_results=not partial_results)
            )
            for chunk in chunks:
                yield speech_pb2.TranscribeRequest(audio=chunk)

        return self.stub.Transcribe(requests(), timeout=self.timeout)



class RealtimeClient:
    """RealtimeService over one grpc.aio channel; use it inside a running event loop.

        async with RealtimeClient(target) as client:
            call = client.converse()
            await call.write(client_event("session.update", session={...}))
            async for event in call: ...

    `credentials` (TLS, client certificate, token) default to plaintext without a token.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None,
                 credentials: Credentials | None = None) -> None:
        self.channel = (credentials or Credentials()).aio_channel(target, CHANNEL_OPTIONS)
        self.stub = RealtimeServiceStub(self.channel)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> RealtimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def converse(self) -> grpc.aio.StreamStreamCall[realtime_pb2.ConverseRequest, realtime_pb2.ConverseResponse]:
        """A Converse stream: `write()` client events, `read()` server events, `done_writing()` to end."""
        return self.stub.Converse(timeout=self.timeout)


@dataclass
class WavAudio:
    samples: np.ndarray  # int16, mono
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate

    def at_rate(self, rate: int) -> WavAudio:
        """The audio resampled to `rate` with the server's streaming resampler (itself when it is already there)."""
        if rate == self.sample_rate:
            return self
        from rtmedia.engines.resample import float_to_pcm16, make_resampler

        resampler = make_resampler(self.sample_rate, rate)
        floats = self.samples.astype(np.float32) / 32768
        pcm = float_to_pcm16(np.concatenate([resampler.process(floats), resampler.flush()]))
        return WavAudio(np.frombuffer(pcm, "<i2"), rate)


def read_wav(path: str | Path) -> WavAudio:
    """A PCM16 WAV file as mono int16 (channels are averaged)."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2 or wav.getcomptype() != "NONE":
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported (sample width {wav.getsampwidth() * 8} bits)")
        channels, rate = wav.getnchannels(), wav.getframerate()
        data = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    if channels > 1:
        data = data.reshape(-1, channels).mean(axis=1).round().astype(np.int16)
    return WavAudio(data.astype(np.int16), rate)


def write_wav(path: str | Path, pcm16: bytes, sample_rate: int, channels: int = 1) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm16)
