"""An uploaded audio file decoded by PyAV into the recogniser's input: PCM16 mono at 16 kHz,
read piece by piece (`PcmDecoder.read`) so a long file is never decoded all at once and the
transcription starts while the rest is still being decoded.

Any container and codec PyAV reads is accepted (wav, mp3, m4a/aac, ogg/opus, flac, webm, ...),
at any sample rate and channel count: `av.AudioResampler` downmixes and resamples. The file's
first audio stream is the one decoded; other streams (video, subtitles) are skipped.

Every call blocks (PyAV decodes on the calling thread): the web front calls it through
`asyncio.to_thread`.

Damaged files: a file PyAV cannot open, one without an audio stream, and one from which no
audio at all decodes raise `AudioDecodeError` with PyAV's reason. A packet that fails to
decode is skipped, as ffmpeg does, and the audio goes on after it; the first such reason is kept
in `problem`. A file cut short (a truncated upload) ends where its readable data ends: the
audio decoded up to there is the result, and a demuxer error there is kept in `problem` too.
"""

from __future__ import annotations

from typing import BinaryIO

import av

RATE = 16000  # the recogniser's input rate
SAMPLE_BYTES = 2  # PCM16 mono
# What PyAV raises on input it cannot read: its FFmpegError classes (which also derive from
# ValueError, OSError or EOFError) and, for metadata or layouts it cannot represent, the builtins.
_READ_ERRORS = (av.FFmpegError, ValueError, OSError, EOFError)


class AudioDecodeError(Exception):
    """The upload is not audio PyAV can decode; the message says why, for the client."""


def reason(exc: BaseException) -> str:
    """PyAV's reason for an error, without its errno prefix (an FFmpegError's `strerror`)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text[:300]


class PcmDecoder:
    """The first audio stream of `source` (a seekable binary file), as PCM16 mono at RATE.
    `samples`: samples returned by `read` so far; `problem`: why decoding skipped a packet or
    stopped early, or None. Raises AudioDecodeError when the file cannot be opened or has no
    audio stream."""

    def __init__(self, source: BinaryIO) -> None:
        try:
            self._container = av.open(source, "r", metadata_errors="replace")
        except _READ_ERRORS as exc:
            raise AudioDecodeError(f"the file could not be read as audio: {reason(exc)}") from None
        audio = [s for s in self._container.streams if s.type == "audio"]
        if not audio:
            kinds = ", ".join(sorted({s.type for s in self._container.streams})) or "none"
            self.close()
            raise AudioDecodeError(f"the file has no audio stream (its streams: {kinds})")
        self.stream = audio[0]
        self.codec = self.stream.codec_context.name
        self._packets = self._container.demux(self.stream)
        self._resampler: av.AudioResampler | None = None
        self._input: tuple[str, str, int] | None = None  # the resampler's input: format, layout, rate
        self._pending = bytearray()
        self._ended = False
        self.samples = 0
        self.problem: str | None = None

    @property
    def seconds(self) -> float:
        return self.samples / RATE

    def read(self, max_bytes: int = RATE * SAMPLE_BYTES) -> bytes:
        """The next piece of PCM16 (at most `max_bytes`, whole samples); b"" at the end. Raises
        AudioDecodeError when the file ends with no audio decoded at all."""
        max_bytes -= max_bytes % SAMPLE_BYTES
        while len(self._pending) < max_bytes and not self._ended:
            self._step()
        piece = bytes(self._pending[:max_bytes])
        del self._pending[:max_bytes]
        self.samples += len(piece) // SAMPLE_BYTES
        if not piece and self.samples == 0:
            why = f": {self.problem}" if self.problem else ""
            raise AudioDecodeError(f"no audio could be decoded from the file ({self.codec}){why}")
        return piece

    def _step(self) -> None:
        """Decode one packet into the pending PCM; at the end of the stream, flush."""
        try:
            packet = next(self._packets)
        except StopIteration:
            self._finish()
            return
        except _READ_ERRORS as exc:  # the data ends or breaks off here: the audio ends too
            self.problem = self.problem or f"reading stopped: {reason(exc)}"
            self._finish()
            return
        try:
            frames = packet.decode()
            for frame in frames:
                frame.pts = None  # the resampler follows the samples, not the file's timestamps
                self._convert(frame)
        except _READ_ERRORS as exc:  # one bad packet: skipped
            self.problem = self.problem or f"a packet failed to decode: {reason(exc)}"

    def _convert(self, frame: av.AudioFrame | None) -> None:
        """Resample `frame` (None: flush) into the pending PCM. A stream whose format, layout or rate
        changes midway (chained streams) gets a fresh resampler from the change on."""
        if frame is not None:
            shape = (frame.format.name, frame.layout.name, frame.sample_rate)
            if shape != self._input:
                self._convert(None)
                self._resampler, self._input = av.AudioResampler(format="s16", layout="mono", rate=RATE), shape
        if self._resampler is None:
            return
        for out in self._resampler.resample(frame):
            self._pending += bytes(out.planes[0])[: out.samples * SAMPLE_BYTES]
        if frame is None:
            self._resampler = self._input = None

    def _finish(self) -> None:
        self._ended = True
        try:
            self._convert(None)
        except _READ_ERRORS as exc:
            self.problem = self.problem or f"the last samples failed to convert: {reason(exc)}"

    def close(self) -> None:
        self._container.close()
