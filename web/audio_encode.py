"""Streaming audio encoders for the OpenAI speech API (rtmedia.web.openai.openai_speech): PCM16 mono
clauses in, the bytes of one growing file out, clause by clause, so a client can play the
first sentence while later ones are still being synthesised.

`StreamEncoder.encode` returns everything the container can give for the samples so far:
FFmpeg's I/O buffer is flushed after every packet (`flush_packets`), and Ogg pages are kept
short (`page_duration`): the Ogg muxer writes a page only once the next one has begun, and its
default page is long enough to hold a whole short sentence back. What stays behind at a clause boundary is only what the codec itself needs to
finish a frame (its frame remainder and lookahead); it leaves with the next clause or with
`close`, which also writes the container's trailer.

The output goes to a write-only sink: FFmpeg then sees an unseekable stream, as the HTTP body
is, and never seeks back to patch a header that has already been sent (a streamed FLAC's
STREAMINFO and an MP3's Xing frame so hold no total length). wav (a streaming RIFF header,
rtmedia.protocol.wav) and pcm (the samples as they are) need no codec.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
from rtmedia.protocol.recording import ByteSink
from rtmedia.protocol.wav import wav_stream_header


@dataclass(frozen=True)
class AudioFormat:
    """One `response_format`: its HTTP Content-Type (OpenAI's), and for the coded formats
    PyAV's container and encoder names, the encoder's bit rate and muxer options. `rates`:
    the output rates it takes, or None for any."""

    content_type: str
    container: str | None = None
    codec: str | None = None
    bit_rate: int = 0
    options: dict[str, str] = field(default_factory=dict)
    rates: tuple[int, ...] | None = None


def _codec_rates(name: str) -> tuple[int, ...]:
    return tuple(sorted(av.codec.Codec(name, "w").audio_rates or ()))


# An Ogg page per Opus packet (a packet is this long): what a clause leaves behind in the muxer
# is then one page.
OGG_PAGE_US = 20_000
FORMATS: dict[str, AudioFormat] = {
    "mp3": AudioFormat("audio/mpeg", "mp3", "libmp3lame", 64_000, rates=_codec_rates("libmp3lame")),
    # Opus runs at 48 kHz inside; rtmedia serves it at the API's rate or at the codec's own.
    "opus": AudioFormat("audio/opus", "ogg", "libopus", 32_000, {"page_duration": str(OGG_PAGE_US)},
                        rates=(24_000, 48_000)),
    "aac": AudioFormat("audio/aac", "adts", "aac", 64_000, rates=_codec_rates("aac")),
    "flac": AudioFormat("audio/flac", "flac", "flac"),
    "wav": AudioFormat("audio/wav"),
    "pcm": AudioFormat("audio/pcm"),
}
# AAC carries at most this many bits per sample and channel; a lower rate gets a lower bit rate.
AAC_BITS_PER_SAMPLE = 4


def rate_problem(fmt: str, rate: int) -> str | None:
    """Why `fmt` cannot be encoded at `rate` Hz, naming the rates it takes, or None."""
    rates = FORMATS[fmt].rates
    if rate <= 0:
        return f"sample_rate={rate} is not a sample rate: it must be a positive number of Hz"
    if rates is not None and rate not in rates:
        return f"sample_rate={rate} cannot be encoded as {fmt}; {fmt} takes: {', '.join(map(str, rates))}"
    return None


class StreamEncoder:
    """One audio file in `fmt` (a FORMATS key) at `rate` Hz mono, written clause by clause.
    Calls are serialised by a lock, so `encode` may run on a worker thread and a `close`
    from elsewhere waits for it. Raises ValueError for a rate `fmt` cannot take."""

    def __init__(self, fmt: str, rate: int) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"response_format {fmt!r} is not one of {', '.join(FORMATS)}")
        if (problem := rate_problem(fmt, rate)) is not None:
            raise ValueError(problem)
        self.format, self.rate = fmt, rate
        self.spec = FORMATS[fmt]
        self.samples = 0  # PCM samples encoded so far
        self.closed = False
        self._lock = threading.Lock()
        self._sink = ByteSink()
        self._container: av.container.OutputContainer | None = None
        self._stream: av.AudioStream | None = None
        if self.spec.codec is not None:
            self._open()

    def _open(self) -> None:
        spec = self.spec
        container = av.open(self._sink, "w", format=spec.container,
                            container_options={"flush_packets": "1", **spec.options})
        try:
            stream = container.add_stream(spec.codec, rate=self.rate, layout="mono")
            if spec.bit_rate:
                bit_rate = spec.bit_rate
                if self.format == "aac":
                    bit_rate = min(bit_rate, AAC_BITS_PER_SAMPLE * self.rate)
                stream.bit_rate = bit_rate
        except BaseException:
            container.close()
            raise
        self._container, self._stream = container, stream

    def encode(self, pcm16: bytes) -> bytes:
        """The file's next bytes for `pcm16` (PCM16 little-endian mono at the encoder's rate);
        the first call's bytes open with the container's header."""
        if len(pcm16) % 2:
            raise ValueError(f"PCM16 audio must be whole samples; got {len(pcm16)} bytes")
        with self._lock:
            if self.closed:
                raise ValueError("the encoder is closed")
            first = self.samples == 0
            self.samples += len(pcm16) // 2
            if self._container is None:
                header = wav_stream_header(self.rate, 1) if first and self.format == "wav" else b""
                return header + pcm16
            if pcm16:
                samples = np.frombuffer(pcm16, "<i2").reshape(1, -1)
                frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
                frame.sample_rate = self.rate
                frame.time_base = Fraction(1, self.rate)
                frame.pts = self.samples - samples.shape[1]
                # PyAV converts to the encoder's sample format and cuts its frame size.
                self._container.mux(self._stream.encode(frame))
            return self._sink.take()

    def close(self) -> bytes:
        """The file's last bytes: the codec's held samples and the container's trailer (for
        wav and pcm, nothing, or a wav header when no audio came). Closing twice gives b""."""
        with self._lock:
            if self.closed:
                return b""
            self.closed = True
            if self._container is None:
                return wav_stream_header(self.rate, 1) if self.format == "wav" and not self.samples else b""
            try:
                self._container.mux(self._stream.encode(None))
            finally:
                self._container.close()
            return self._sink.take()

    def discard(self) -> None:
        """Release the encoder's resources without wanting its last bytes (the response has
        ended early); never raises."""
        with contextlib.suppress(Exception):
            self.close()


class G711Encoder:
    """PCM16 mono at 8 kHz to G.711 μ-law (`pcm_mulaw`) or A-law (`pcm_alaw`), a byte per sample,
    chunk by chunk (the Realtime API's audio/pcmu and audio/pcma output)."""

    RATE = 8000

    def __init__(self, codec: str) -> None:
        self._context = av.CodecContext.create(codec, "w")
        self._context.sample_rate, self._context.format, self._context.layout = self.RATE, "s16", "mono"
        self._context.open()
        self._pts = 0

    def encode(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, "<i2")
        if not samples.size:
            return b""
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = self.RATE, self._pts, Fraction(1, self.RATE)
        self._pts += samples.size
        return b"".join(bytes(packet) for packet in self._context.encode(frame))
