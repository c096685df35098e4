"""Test audio files: Piper speech (tests/support/speech.py) encoded by PyAV into the containers
and codecs clients upload (mp3, ogg/opus, m4a, flac, wav, webm), at any rate and channel count.

Encoding goes through PyAV, the same library the web front decodes with, but on an independent
path (the encoder's own resampler settings, the muxers' own framing), so a test file is what
ffmpeg-based tools would write.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

from tests.support.speech import Speaker


@dataclass(frozen=True)
class Kind:
    """A file kind: PyAV's muxer name, its codec, and the rate the codec runs at (None: the input's)."""

    container: str
    codec: str
    codec_rate: int | None = None


KINDS = {
    "mp3": Kind("mp3", "libmp3lame"),
    "ogg": Kind("ogg", "libopus", 48000),
    "opus": Kind("ogg", "libopus", 48000),
    "m4a": Kind("ipod", "aac"),  # aac in mp4 (the "ipod" muxer writes .m4a)
    "flac": Kind("flac", "flac"),
    "wav": Kind("wav", "pcm_s16le"),
    "webm": Kind("webm", "libopus", 48000),
}


def encode(samples: np.ndarray, rate: int, kind: str, channels: int = 1, bit_rate: int | None = None) -> bytes:
    """`samples` (mono int16 at `rate`) as a file of `kind` (a KINDS key) with `channels`
    channels: stereo copies the speech to both, the right one a little quieter, so a downmix
    has to add them. `bit_rate`: the encoder's, in bits per second (None: its default)."""
    spec = KINDS[kind]
    layout = {1: "mono", 2: "stereo"}[channels]
    if channels == 1:
        planar = samples.reshape(1, -1)
    else:
        planar = np.stack([samples, (samples.astype(np.int32) * 3 // 4).astype(np.int16)])
    interleaved = np.ascontiguousarray(planar.T.reshape(1, -1))
    out_rate = spec.codec_rate or rate
    buf = io.BytesIO()
    with av.open(buf, "w", format=spec.container) as out:
        stream = out.add_stream(spec.codec, rate=out_rate, layout=layout)
        if bit_rate is not None:
            stream.bit_rate = bit_rate
        ctx = stream.codec_context
        resampler = av.AudioResampler(format=ctx.format, layout=layout, rate=out_rate,
                                      frame_size=ctx.frame_size or None)
        frame = av.AudioFrame.from_ndarray(interleaved, format="s16", layout=layout)
        frame.sample_rate = rate
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(piece):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@dataclass(frozen=True)
class Spoken:
    """A test recording: its samples (mono int16 at `rate`), the sentences it says and where
    each one is, in seconds from the start."""

    samples: np.ndarray
    rate: int
    sentences: tuple[str, ...]
    spans: tuple[tuple[float, float], ...]

    @property
    def text(self) -> str:
        return " ".join(self.sentences)

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate

    def file(self, kind: str, channels: int = 1) -> bytes:
        return encode(self.samples, self.rate, kind, channels)


def recording(speaker: Speaker, sentences: list[str] | tuple[str, ...], rate: int = 16000, lead_s: float = 0.5,
              gap_s: float = 1.5, tail_s: float = 0.5) -> Spoken:
    """`sentences` spoken one after another with `gap_s` of silence between them, `lead_s`
    before the first and `tail_s` after the last."""
    parts: list[np.ndarray] = [speaker.silence(lead_s, rate)]
    spans = []
    at = len(parts[0])
    for n, sentence in enumerate(sentences):
        if n:
            parts.append(speaker.silence(gap_s, rate))
            at += len(parts[-1])
        speech = speaker.say(sentence, rate)
        parts.append(speech)
        spans.append((at / rate, (at + len(speech)) / rate))
        at += len(speech)
    parts.append(speaker.silence(tail_s, rate))
    return Spoken(np.concatenate(parts), rate, tuple(sentences), tuple(spans))


def video_only(frames: int = 5) -> bytes:
    """A small mp4 with one video stream (mpeg4, grey frames) and no audio."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 128, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
