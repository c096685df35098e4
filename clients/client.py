"""The Python client library: SpeechClient (and its asyncio twin), VideoClient, and RealtimeClient,
the channel for RealtimeSession (clients/session.py); one place for TLS, tokens and channel options.

Each call raises `RtmediaError` (clients/errors.py) for a failed status, never a bare grpc error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import grpc
import numpy as np
from rtmedia.clients.channels import DEFAULT_TARGET, aio_channel, channel
from rtmedia.clients.credentials import Credentials
from rtmedia.clients.errors import RtmediaError
from rtmedia.v1 import common_pb2, realtime_pb2, speech_pb2, speech_pb2_grpc, video_pb2, video_pb2_grpc
from rtmedia.v1.realtime_pb2_grpc import RealtimeServiceStub

if TYPE_CHECKING:
    from rtmedia.clients.session import RealtimeSession

# Rates the server takes PCM16 at; other input rates are resampled to 16 kHz here first.
SERVER_RATES = (8000, 16000, 24000, 48000)
Audio = bytes | np.ndarray | Iterable[bytes]  # what transcribe() takes: PCM16 bytes, samples, or chunks


@dataclass
class SpeechChunk:
    """A piece of synthesized speech: PCM16 bytes (or int16 samples, with `numpy=True`)."""

    audio: bytes | np.ndarray
    sample_rate: int
    channels: int
    chunk_index: int
    text: str  # the words this chunk speaks
    is_final: bool

    @property
    def seconds(self) -> float:
        samples = len(self.audio) if isinstance(self.audio, np.ndarray) else len(self.audio) // 2
        return samples / self.channels / self.sample_rate


RESAMPLED_RATES = range(8000, 192001)  # output rates a voice lacks are made here from its own


def _asked_rate(voices: speech_pb2.ListVoicesResponse | None, voice: str, rate: int) -> int:
    """The rate to ask the server for: `rate` when the voice is served at it (or the server is to
    judge it: an unknown voice, a rate out of range), else 0 (the voice's own; resampled here)."""
    if rate <= 0 or voices is None:
        return rate
    served = {v.name: v.supported_sample_rates for v in voices.voices}
    rates = served.get(voice) if voice else (voices.voices[0].supported_sample_rates if voices.voices else None)
    return 0 if rates is not None and rate not in rates and rate in RESAMPLED_RATES else rate


class _Speech:
    """One Synthesize call's replies as SpeechChunks at `rate` (0: the voice's own), resampled here
    (the engines' streaming resampler) when the server sends another rate."""

    def __init__(self, rate: int, numpy: bool) -> None:
        self.rate, self.numpy = rate, numpy
        self.resampler: Any = None

    def chunk(self, reply: speech_pb2.SynthesizeResponse) -> SpeechChunk:
        pcm = reply.audio
        if reply.chunk_index == 0 and self.rate and reply.sample_rate != self.rate:
            from rtmedia.engines.audio.resample import make_resampler

            self.resampler = make_resampler(reply.sample_rate, self.rate)
        if self.resampler is not None:
            from rtmedia.engines.audio.resample import float_to_pcm16

            out = self.resampler.process(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768)
            pcm = float_to_pcm16(np.concatenate([out, self.resampler.flush()]) if reply.is_final else out)
        audio: bytes | np.ndarray = np.frombuffer(pcm, "<i2") if self.numpy else pcm
        return SpeechChunk(audio, self.rate or reply.sample_rate, reply.channels or 1, reply.chunk_index,
                           reply.text, reply.is_final)


def _synthesize_request(voices: speech_pb2.ListVoicesResponse | None, text: str, voice: str, rate: int,
                        speed: float) -> speech_pb2.SynthesizeRequest:
    return speech_pb2.SynthesizeRequest(text=text, voice=voice, sample_rate=_asked_rate(voices, voice, rate),
                                        speed=speed, framing=speech_pb2.AUDIO_FRAMING_PCM16)


def _transcribe_requests(audio: Audio, sample_rate: int, chunk_ms: int, partial_results: bool,
                         language: str) -> Iterator[speech_pb2.TranscribeRequest]:
    rate = sample_rate if sample_rate in SERVER_RATES else 16000
    fmt = common_pb2.AudioFormat(encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=rate, channels=1)
    yield speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
        audio_format=fmt, language=language, disable_partial_results=not partial_results))
    if isinstance(audio, bytes | bytearray | np.ndarray):
        from rtmedia.clients.audio_file import pcm16, resample

        data = pcm16(audio)
        if rate != sample_rate:
            data = resample(np.frombuffer(data, "<i2"), sample_rate, rate).astype("<i2").tobytes()
        step = max(2, rate * chunk_ms // 1000 * 2)
        for offset in range(0, len(data), step):
            yield speech_pb2.TranscribeRequest(audio=data[offset:offset + step])
        return
    if rate != sample_rate:
        raise ValueError(f"a stream of chunks must be at one of {SERVER_RATES} Hz, not {sample_rate}")
    for chunk in audio:
        yield speech_pb2.TranscribeRequest(audio=bytes(chunk))


class SpeechClient:
    """SpeechService, blocking: `synthesize()` streams speech, `transcribe()` streams transcripts.

        with SpeechClient() as speech:
            for chunk in speech.synthesize("Hello.", sample_rate=16000): out.write(chunk.audio)

    Server errors raise `RtmediaError` (clients/errors.py) with the status's reason.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None,
                 credentials: Credentials | None = None) -> None:
        self.channel = channel(target, credentials)
        self.stub = speech_pb2_grpc.SpeechServiceStub(self.channel)
        self.timeout = timeout
        self._voices: speech_pb2.ListVoicesResponse | None = None  # asked once, for the rates

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpeechClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_voices(self) -> speech_pb2.ListVoicesResponse:
        try:
            return self.stub.ListVoices(speech_pb2.ListVoicesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None

    def describe_recognizer(self) -> speech_pb2.DescribeRecognizerResponse:
        """The server's recogniser: `name`, `languages` (ISO 639-1), `runtime`, `compute_type`,
        `multilingual`; `transcribe(language=...)` takes one of its languages."""
        try:
            return self.stub.DescribeRecognizer(speech_pb2.DescribeRecognizerRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None

    def synthesize(self, text: str, voice: str = "", sample_rate: int = 0, *, speed: float = 0.0,
                   numpy: bool = False) -> Iterator[SpeechChunk]:
        """Speech for `text`, chunk by chunk as it is made, at `sample_rate` (any rate; default the
        voice's own: rates the voice is not served at are resampled here)."""
        if sample_rate > 0 and self._voices is None:
            self._voices = self.list_voices()
        request = _synthesize_request(self._voices, text, voice, sample_rate, speed)
        speech = _Speech(sample_rate, numpy)
        try:
            for reply in self.stub.Synthesize(request, timeout=self.timeout):
                yield speech.chunk(reply)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None

    def transcribe(self, audio: Audio, sample_rate: int, *, chunk_ms: int = 100, partial_results: bool = True,
                   language: str = "") -> Iterator[speech_pb2.TranscribeResponse]:
        """Transcripts of `audio` (PCM16 bytes, numpy samples, or an iterable of PCM16 chunks) as they
        come: partial results, then each utterance's final one (`is_final`, with its `language`).
        `language`: what it is said in ("fr", "fr-FR", "french"); "" for English on an
        English-only recogniser, detected on a multilingual one; one not served raises
        RtmediaError (reason BAD_LANGUAGE, naming the languages served)."""
        requests = _transcribe_requests(audio, sample_rate, chunk_ms, partial_results, language)
        try:
            yield from self.stub.Transcribe(requests, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None


class AsyncSpeechClient:
    """SpeechClient for asyncio: the same calls as async iterators."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None,
                 credentials: Credentials | None = None) -> None:
        self.channel = aio_channel(target, credentials)
        self.stub = speech_pb2_grpc.SpeechServiceStub(self.channel)
        self.timeout = timeout
        self._voices: speech_pb2.ListVoicesResponse | None = None  # asked once, for the rates

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncSpeechClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def list_voices(self) -> speech_pb2.ListVoicesResponse:
        try:
            return await self.stub.ListVoices(speech_pb2.ListVoicesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None

    async def describe_recognizer(self) -> speech_pb2.DescribeRecognizerResponse:
        try:
            return await self.stub.DescribeRecognizer(speech_pb2.DescribeRecognizerRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None

    async def synthesize(self, text: str, voice: str = "", sample_rate: int = 0, *, speed: float = 0.0,
                         numpy: bool = False) -> AsyncIterator[SpeechChunk]:
        if sample_rate > 0 and self._voices is None:
            self._voices = await self.list_voices()
        request = _synthesize_request(self._voices, text, voice, sample_rate, speed)
        speech = _Speech(sample_rate, numpy)
        try:
            async for reply in self.stub.Synthesize(request, timeout=self.timeout):
                yield speech.chunk(reply)
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None

    async def transcribe(self, audio: Audio, sample_rate: int, *, chunk_ms: int = 100,
                         partial_results: bool = True, language: str = ""
                         ) -> AsyncIterator[speech_pb2.TranscribeResponse]:
        requests = _transcribe_requests(audio, sample_rate, chunk_ms, partial_results, language)
        try:
            async for reply in self.stub.Transcribe(requests, timeout=self.timeout):
                yield reply
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None


@dataclass
class VideoChunk:
    """One decoded chunk: `frames` (T x H x W x 3 uint8) or `data` (an fMP4 fragment), per `format`."""

    chunk_index: int
    total_chunks: int
    frame_start: int
    frame_count: int
    width: int
    height: int
    fps: float
    is_final: bool
    frames: np.ndarray | None = None
    data: bytes = b""


VIDEO_DTYPES = {np.dtype(np.float32): video_pb2.TENSOR_DTYPE_FLOAT32,
                np.dtype(np.float16): video_pb2.TENSOR_DTYPE_FLOAT16}
FRAME_PLANS = {"causal": video_pb2.FRAME_PLAN_CAUSAL, "overlapped": video_pb2.FRAME_PLAN_OVERLAPPED}


class VideoClient:
    """VideoService, blocking: `decode()` yields a latent's frames chunk by chunk while the VAE decodes."""

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None,
                 credentials: Credentials | None = None) -> None:
        self.channel = channel(target, credentials)
        self.stub = video_pb2_grpc.VideoServiceStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> VideoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def decode(self, latent: np.ndarray, *, format: Literal["numpy", "fmp4"] = "numpy", fps: float = 16.0,
               plan: Literal["causal", "overlapped"] = "causal", width: int = 0, height: int = 0,
               normalized: bool = False, steps_per_chunk: int = 0, one_shot: bool = False) -> Iterator[VideoChunk]:
        """The frames of `latent` (C x T x H x W, float32/float16): as numpy arrays, or as fragments of a
        fragmented H.264 MP4 (`format="fmp4"`; their concatenation is the file)."""
        if latent.ndim == 5 and latent.shape[0] == 1:
            latent = latent[0]
        if latent.ndim != 4:
            raise ValueError(f"a latent is C x T x H x W or 1 x C x T x H x W, not shape {latent.shape}")
        dtype = np.dtype(latent.dtype).newbyteorder("=")
        if dtype not in VIDEO_DTYPES:
            raise ValueError(f"a latent is float32 or float16, not {latent.dtype}")
        if format not in ("numpy", "fmp4"):
            raise ValueError(f"format is 'numpy' or 'fmp4', not {format!r}")
        data = np.ascontiguousarray(latent.astype(dtype.newbyteorder("<"))).tobytes()
        request = video_pb2.DecodeVideoRequest(
            latent=video_pb2.Tensor(shape=latent.shape, dtype=VIDEO_DTYPES[dtype], data=data),
            normalized=normalized, plan=FRAME_PLANS[plan], width=width, height=height, fps=fps,
            format=video_pb2.VIDEO_FORMAT_RAW_RGB24 if format == "numpy" else video_pb2.VIDEO_FORMAT_FMP4_H264,
            latent_steps_per_chunk=steps_per_chunk, one_shot=one_shot)
        parts: list[bytes] = []
        try:
            for reply in self.stub.DecodeVideo(request, timeout=self.timeout):
                if reply.part != len(parts):
                    raise ValueError(f"chunk {reply.chunk_index} part {reply.part} arrived out of order")
                parts.append(reply.data)  # a chunk bigger than a message comes in parts
                if reply.part + 1 < reply.parts:
                    continue
                payload, parts = b"".join(parts), []
                chunk = VideoChunk(reply.chunk_index, reply.total_chunks, reply.frame_start, reply.frame_count,
                                   reply.width, reply.height, reply.fps, reply.is_final)
                if format == "numpy":
                    chunk.frames = np.frombuffer(payload, np.uint8).reshape(
                        reply.frame_count, reply.height, reply.width, 3)
                else:
                    chunk.data = payload
                yield chunk
        except grpc.RpcError as exc:
            raise RtmediaError.from_rpc(exc) from None


class RealtimeClient:
    """A grpc.aio channel for Converse sessions: `session(**config)` opens a `RealtimeSession` on it.

        async with RealtimeClient(target) as client:
            async with client.session(instructions="Be brief.") as session: ...

    `converse()` gives the bare stream (ConverseRequest / ConverseResponse messages) instead.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None,
                 credentials: Credentials | None = None, options: Sequence[tuple[str, Any]] = ()) -> None:
        self.channel = aio_channel(target, credentials, options)
        self.stub = RealtimeServiceStub(self.channel)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> RealtimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def session(self, metadata: Sequence[tuple[str, str]] = (), **config: Any) -> RealtimeSession:
        """A session on this channel (enter it with `async with`)."""
        from rtmedia.clients.session import RealtimeSession

        return RealtimeSession(channel=self.channel, metadata=metadata, timeout=self.timeout, **config)

    def converse(self) -> grpc.aio.StreamStreamCall[realtime_pb2.ConverseRequest, realtime_pb2.ConverseResponse]:
        """A bare Converse stream: `write()` client events, `read()` server events, `done_writing()` to end."""
        return self.stub.Converse(timeout=self.timeout)
