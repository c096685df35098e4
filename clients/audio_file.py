"""Audio files on the client side: any file PyAV decodes in, the container and codec a file name
says out, and `-` for standard input and output, so the commands that read or write audio
(`transcribe`, `talk`, `synth`, `loadtest --audio`) take whatever recording a user has and compose
in pipes.

Reading (`read_audio`): the file's first audio stream, whatever its container and codec (wav, mp3,
m4a/aac, ogg/opus, flac, webm, ...), rate and channel count, decoded and converted by
`av.AudioResampler` into mono int16 at the file's own rate or at the rate asked for. `-` reads
standard input: a container PyAV recognises (`cat talk.mp3 | rtmedia transcribe -`), or raw PCM16
mono when its rate is given (`raw_rate`, the commands' `--rate`), as `rtmedia synth -o -` writes it.

Writing (`AudioWriter`): PCM16 mono chunks in as they arrive, one file out, its container and codec
chosen by the extension or a format name (FORMATS). Codecs that do not take the audio's rate get
the nearest rate they take, by PyAV's resampler: Opus always runs at 48 kHz, which is the rate the
file then decodes back at (`file_rate`). `-` writes raw PCM16 to standard output, or with a format
named, that format as a stream (an m4a then as fragmented MP4, as a pipe cannot be seeked back).

Every problem a user can cause (a missing file, a directory, a file that is not audio or holds
none, an unknown extension, an output that cannot be created) is an `AudioFileError` whose
message names the file and the problem in one line.
"""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO, Any

import av
import numpy as np
from rtmedia.engines.audio.resample import float_to_pcm16

STDIO = "-"
SAMPLE_BYTES = 2  # PCM16 mono
# What PyAV raises on input it cannot read: its FFmpegError classes (which also derive from
# ValueError, OSError or EOFError) and, for metadata or layouts it cannot represent, the builtins.
_AV_ERRORS = (av.FFmpegError, ValueError, OSError, EOFError)


class AudioFileError(ValueError):
    """A file that cannot be read or written as audio; the message names it and says why."""


@dataclass(frozen=True)
class Audio:
    """Mono int16 samples at `sample_rate`."""

    samples: np.ndarray
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate

    def at_rate(self, rate: int) -> Audio:
        """The audio resampled to `rate` (itself when it is already there)."""
        if rate == self.sample_rate:
            return self
        return Audio(resample(self.samples, self.sample_rate, rate), rate)


def _name(path: str | Path) -> str:
    return "standard input" if str(path) == STDIO else str(path)


def _reason(exc: BaseException) -> str:
    """PyAV's or the OS's reason for an error, without errno or file name."""
    return str(getattr(exc, "strerror", None) or exc or type(exc).__name__)[:300]


def _frame(samples: np.ndarray, rate: int, pts: int = 0) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, "<i2").reshape(1, -1), format="s16",
                                       layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = rate, pts, Fraction(1, rate)
    return frame


def _pcm(frames: list[av.AudioFrame]) -> bytes:
    """Packed s16 mono frames as bytes (a plane may be padded past its samples)."""
    return b"".join(bytes(f.planes[0])[:f.samples * SAMPLE_BYTES] for f in frames)


def pcm16(audio: bytes | np.ndarray) -> bytes:
    """PCM16 little-endian bytes of `audio`: bytes as they are, int16 samples, or floats in [-1, 1]."""
    if isinstance(audio, bytes | bytearray | memoryview):
        return bytes(audio)
    samples = np.asarray(audio)
    if samples.dtype.kind == "f":
        return float_to_pcm16(samples)
    if samples.dtype.kind not in "iu":
        raise TypeError(f"audio must be bytes or a numpy array of samples, not {samples.dtype} data")
    return np.clip(samples, -32768, 32767).astype("<i2").tobytes()


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Mono int16 `samples` at `from_rate` resampled to `to_rate` by PyAV."""
    if from_rate == to_rate or not len(samples):
        return np.asarray(samples, np.int16)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=to_rate)
    out = _pcm([*resampler.resample(_frame(samples, from_rate)), *resampler.resample(None)])
    return np.frombuffer(out, "<i2").copy()


# ---- reading ------------------------------------------------------------------------------------

def _source(path: str | Path) -> bytes | str:
    """What PyAV opens: a file's path (checked here, for a clear message), or standard input's bytes."""
    if str(path) == STDIO:
        stdin = sys.stdin.buffer
        if stdin.isatty():
            raise AudioFileError("standard input is a terminal: pipe audio into it (`... | rtmedia transcribe -`)")
        data = stdin.read()
        if not data:
            raise AudioFileError("standard input is empty")
        return data
    p = Path(path)
    if not p.exists():
        raise AudioFileError(f"{p}: no such file")
    if p.is_dir():
        raise AudioFileError(f"{p}: is a directory, not an audio file")
    if not os.access(p, os.R_OK):
        raise AudioFileError(f"{p}: cannot read it (permission denied)")
    if p.stat().st_size == 0:
        raise AudioFileError(f"{p}: the file is empty")
    return str(p)


def read_audio(path: str | Path, rate: int | None = None, *, raw_rate: int | None = None) -> Audio:
    """The audio of `path` (STDIO: standard input) as mono int16, at `rate` when given, else at the
    file's own rate. With `raw_rate` the input is raw PCM16 mono at that rate rather than a file
    PyAV recognises. Raises AudioFileError naming the file and the problem."""
    source = _source(path)
    if raw_rate is not None:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        if len(data) % SAMPLE_BYTES:
            raise AudioFileError(f"{_name(path)}: {len(data)} bytes is not whole PCM16 samples")
        audio = Audio(np.frombuffer(data, "<i2").copy(), raw_rate)
        return audio.at_rate(rate) if rate else audio
    try:
        container = av.open(io.BytesIO(source) if isinstance(source, bytes) else source, "r",
                            metadata_errors="replace")
    except _AV_ERRORS as exc:
        raise AudioFileError(f"{_name(path)}: not an audio file ({_reason(exc)})") from None
    with container:
        streams = [s for s in container.streams if s.type == "audio"]
        if not streams:
            kinds = ", ".join(sorted({s.type for s in container.streams})) or "none"
            raise AudioFileError(f"{_name(path)}: not an audio file (no audio stream; its streams: {kinds})")
        return _decode(container, streams[0], rate, _name(path))


def _decode(container: Any, stream: Any, rate: int | None, name: str) -> Audio:
    """Every frame of `stream` through a resampler to mono s16; a packet that fails to decode is
    skipped (as ffmpeg does), a stream whose shape changes midway gets a fresh resampler."""
    out: list[bytes] = []
    resampler: av.AudioResampler | None = None
    shape: tuple[str, str, int] | None = None
    problem = ""
    try:
        for packet in container.demux(stream):
            try:
                frames = packet.decode()
            except _AV_ERRORS as exc:
                problem = problem or _reason(exc)
                continue
            for frame in frames:
                frame.pts = None  # the resampler follows the samples, not the file's timestamps
                if (frame.format.name, frame.layout.name, frame.sample_rate) != shape:
                    if resampler is not None:
                        out.append(_pcm(resampler.resample(None)))
                    shape = (frame.format.name, frame.layout.name, frame.sample_rate)
                    rate = rate or frame.sample_rate
                    resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
                out.append(_pcm(resampler.resample(frame)))
    except _AV_ERRORS as exc:  # the data breaks off here (a cut file): the audio ends too
        problem = problem or _reason(exc)
    if resampler is not None:
        out.append(_pcm(resampler.resample(None)))
    samples = np.frombuffer(b"".join(out), "<i2").copy()
    if not len(samples) or rate is None:
        why = f": {problem}" if problem else ""
        raise AudioFileError(f"{name}: no audio could be decoded from it ({stream.codec_context.name}){why}")
    return Audio(samples, rate)


def probe_audio(path: Path) -> str | None:
    """Why `path` is not a file with an audio stream PyAV can open, or None when it is one."""
    try:
        if path.stat().st_size == 0:
            return "the file is empty"
        with av.open(str(path), "r", metadata_errors="replace") as container:
            if not any(s.type == "audio" for s in container.streams):
                return "no audio stream"
    except _AV_ERRORS as exc:
        return _reason(exc)
    return None


# ---- writing ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutputFormat:
    """A format `AudioWriter` writes: PyAV's muxer and encoder (None: raw PCM16)."""

    container: str | None
    codecs: tuple[str, ...] = ()  # the first one this PyAV build has is used

    @property
    def codec(self) -> str:
        return next((c for c in self.codecs if c in av.codecs_available), self.codecs[0])


FORMATS: dict[str, OutputFormat] = {
    "wav": OutputFormat("wav", ("pcm_s16le",)),
    "mp3": OutputFormat("mp3", ("libmp3lame", "mp3_mf", "libshine")),
    "ogg": OutputFormat("ogg", ("libopus", "opus")),  # Opus in Ogg
    "opus": OutputFormat("ogg", ("libopus", "opus")),
    "flac": OutputFormat("flac", ("flac",)),
    "m4a": OutputFormat("ipod", ("aac",)),  # AAC in MP4 (the "ipod" muxer writes .m4a)
    "pcm": OutputFormat(None),  # raw PCM16 little-endian mono
}
EXTENSIONS = {f".{name}": name for name in FORMATS} | {".raw": "pcm"}
OPUS_RATE = 48000  # Ogg Opus decodes at 48 kHz whatever rate went in


def output_format(path: str | Path, fmt: str | None = None) -> str:
    """The FORMATS name for writing `path`: `fmt` when given, else the extension's (raw PCM16 for
    STDIO); first checks that `path` can be created, so a command fails before any work."""
    if str(path) != STDIO:
        _check_writable(Path(path))
    if fmt is not None:
        if fmt not in FORMATS:
            raise AudioFileError(f"unknown audio format {fmt!r}; the formats are: {', '.join(FORMATS)}")
        return fmt
    if str(path) == STDIO:
        return "pcm"
    suffix = Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        raise AudioFileError(f"{path}: cannot tell the audio format from {suffix or 'no extension'!r}; "
                             f"name the file {', '.join(EXTENSIONS)} or give --format")
    return EXTENSIONS[suffix]


def _check_writable(path: Path) -> None:
    folder = path.absolute().parent
    if path.is_dir():
        raise AudioFileError(f"cannot write {path}: it is a directory")
    if not folder.is_dir():
        raise AudioFileError(f"cannot write {path}: no such directory {folder}")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise AudioFileError(f"cannot write {path}: permission denied")


def codec_rate(codec: str, rate: int) -> int:
    """The rate `codec` encodes audio of `rate` Hz at: `rate` when it takes it, else the lowest
    rate it takes above it (or its highest); Opus always at OPUS_RATE."""
    if "opus" in codec:
        return OPUS_RATE
    rates = sorted(av.codec.Codec(codec, "w").audio_rates or ())
    if not rates or rate in rates:
        return rate
    return next((r for r in rates if r >= rate), rates[-1])


class _Sink:
    """A write-only file over standard output: without seek, FFmpeg streams the container."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.out.flush()
        return len(data)


class AudioWriter:
    """One audio file (STDIO: standard output) in `fmt` or the format `path`'s extension names,
    written from PCM16 mono chunks at `rate` as they arrive; `close` (or leaving the `with`
    block) finishes it. `file_rate` is the rate the file decodes back at."""

    def __init__(self, path: str | Path, rate: int, fmt: str | None = None) -> None:
        if rate <= 0:
            raise AudioFileError(f"{rate} Hz is not a sample rate")
        self.path, self.rate = path, rate
        self.format = output_format(path, fmt)
        self._where = "standard output" if str(path) == STDIO else str(path)
        self.samples = 0
        self._raw: IO[bytes] | None = None
        self._container: Any = None
        self._stream: Any = None
        self._resampler: av.AudioResampler | None = None
        spec = FORMATS[self.format]
        to_stdout = str(path) == STDIO
        try:
            if spec.container is None:
                self._raw = sys.stdout.buffer if to_stdout else open(path, "wb")
                self.file_rate = rate
                return
            target: Any = _Sink(sys.stdout.buffer) if to_stdout else str(path)
            options = {"movflags": "frag_keyframe+empty_moov"} if to_stdout and spec.container == "ipod" else {}
            self._container = av.open(target, "w", format=spec.container, options=options)
        except OSError as exc:
            raise AudioFileError(f"cannot write {self._where}: {_reason(exc)}") from None
        codec = spec.codec
        self.file_rate = codec_rate(codec, rate)
        self._stream = self._container.add_stream(codec, rate=self.file_rate, layout="mono")
        ctx = self._stream.codec_context
        self._resampler = av.AudioResampler(format=ctx.format.name, layout="mono", rate=self.file_rate,
                                            frame_size=ctx.frame_size or None)

    @property
    def seconds(self) -> float:
        """Seconds of audio written so far."""
        return self.samples / self.rate

    def write(self, pcm16: bytes) -> None:
        """Append PCM16 little-endian mono samples at the writer's rate."""
        if len(pcm16) % SAMPLE_BYTES:
            raise ValueError(f"PCM16 audio must be whole samples; got {len(pcm16)} bytes")
        if not pcm16:
            return
        try:
            if self._raw is not None:
                self._raw.write(pcm16)
                self._raw.flush()
            else:
                assert self._resampler is not None
                frame = _frame(np.frombuffer(pcm16, "<i2"), self.rate, self.samples)
                for piece in self._resampler.resample(frame):
                    self._container.mux(self._stream.encode(piece))
        except BrokenPipeError:
            raise
        except OSError as exc:  # a full disk, a closed pipe, a file removed under us
            raise AudioFileError(f"cannot write {self._where}: {_reason(exc)}") from None
        self.samples += len(pcm16) // SAMPLE_BYTES

    def close(self) -> None:
        """Finish the file: the codec's held samples and the container's trailer. Idempotent."""
        if self._raw is not None:
            if self._raw is not sys.stdout.buffer:
                self._raw.close()
            self._raw = None
        if self._container is not None:
            container, self._container = self._container, None
            try:
                assert self._resampler is not None
                for piece in self._resampler.resample(None):
                    container.mux(self._stream.encode(piece))
                container.mux(self._stream.encode(None))
            finally:
                container.close()

    def __enter__(self) -> AudioWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_audio(path: str | Path, pcm16: bytes, rate: int, fmt: str | None = None) -> None:
    """PCM16 mono at `rate` as one file (see AudioWriter)."""
    with AudioWriter(path, rate, fmt) as writer:
        writer.write(pcm16)
