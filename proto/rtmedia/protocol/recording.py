"""Stereo recordings of a conversation: the user on the left, the agent on the right, one clock
(docs/operations.md#recordings). The server's session recordings (rtmedia.server.observe.recording) and
`rtmedia talk --record` (rtmedia.clients.commands.talk) both write them with these parts.

`Timeline` lays audio on the recording's clock, in 24 kHz samples from its start. Audio comes
as runs (`add`), each under a key (the user's input, one reply): a run's audio is continuous
from where it began, and a chunk that comes later than its continuous place (a reply whose
playback ran dry, input lost on the way) starts a new stretch where it came. A reply the
listener stopped hearing is cut (`cut`): what it held past that point goes. The caller takes
the mixed stereo samples up to a point (`take`), after which they can no longer be cut; it
holds them back long enough for a cut to arrive (the server a couple of seconds).

`OggOpusFile` encodes the stereo samples as one Ogg Opus file through PyAV (libopus) and
writes its bytes to a file descriptor itself, so that a full disk or a closed file is an
OSError of the caller's own write (never lost inside FFmpeg), and counts them.

Resampling to 24 kHz is the caller's resampler (`make_resampler(src, dst)`, with `process` and
`flush` as rtmedia.engines.audio.resample's have): this module imports nothing but the protocol.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import av
import numpy as np

RATE = 24000  # the timeline's samples, which the encoder takes (an Opus stream decodes at 48 kHz)
FILE_RATE = 48000  # what a decoder of the file gives
# Two channels of speech in libopus's "audio" mode at complexity 0 (docs/operations.md#recordings
# has the measurements): at 40 kbit/s the channels stay apart (at 32 one channel's speech leaks
# into the other at -30 dB, at 24 at -16 dB, which a recording of who said what must not do), and
# it costs 1.4 ms of CPU per second of audio, against 4 ms in "voip" mode. The 24 kHz timeline
# holds every voice rtmedia speaks and hears at full band (the replies are 24 kHz) and halves the
# resampling a 48 kHz one would cost.
BIT_RATE = 40_000
COMPLEXITY = 0
HOLD_MS = 2000  # the agent's channel is encoded this far behind the input: time for a cut to come
WRITE_EVERY_MS = 200  # and once this much more is ready
PAGE_US = 1_000_000  # an Ogg page per second: a recording cut short loses at most the last second


class ByteSink:
    """A write-only file for PyAV: the container's bytes gather here until `take`. Without seek
    and tell, FFmpeg treats it as an unseekable stream (an HTTP body, a file written as it grows)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.data += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


class OggOpusFile:
    """A stereo Ogg Opus file (24 kHz in, 48 kHz out) on the file descriptor `fd` (closed by `close`). `write` and
    `close` return the bytes they wrote; an OSError from the disk is raised to the caller, and
    the file is then only to be closed."""

    def __init__(self, fd: int, bit_rate: int = BIT_RATE, complexity: int = COMPLEXITY) -> None:
        self.fd = fd
        self.bytes = 0
        self.samples = 0  # per channel, encoded so far
        self._sink = ByteSink()
        self._container = av.open(self._sink, "w", format="ogg",
                                  container_options={"flush_packets": "1", "page_duration": str(PAGE_US)})
        try:
            self._stream = self._container.add_stream("libopus", rate=RATE, layout="stereo")
            self._stream.bit_rate = bit_rate
            self._stream.codec_context.options = {"compression_level": str(complexity), "application": "audio"}
        except BaseException:
            self._container.close()
            raise

    def write(self, stereo: np.ndarray) -> int:
        """Encode int16 samples of shape (n, 2) (left, right) and write what the file gained."""
        if stereo.shape[0]:
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(stereo, "<i2").reshape(1, -1), format="s16",
                                               layout="stereo")
            frame.sample_rate, frame.time_base, frame.pts = RATE, Fraction(1, RATE), self.samples
            self.samples += stereo.shape[0]
            self._container.mux(self._stream.encode(frame))
        return self._flush()

    def _flush(self) -> int:
        data = self._sink.take()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.bytes += len(data)
        return len(data)

    def close(self, finish: bool = True) -> int:
        """`finish`: encode what the codec holds and write the trailer; else (after a write
        failed) only let go of the encoder. The descriptor is closed either way."""
        try:
            if finish:
                self._container.mux(self._stream.encode(None))
            self._container.close()
            return self._flush() if finish else 0
        finally:
            os.close(self.fd)


RESYNC_S = 0.5  # input this much later than the clock expects: the client stopped sending, the clock follows
RELAX_PER_S = 0.02  # else the clock follows a sender that falls behind by this much per second


class InputClock:
    """The conversation's clock: milliseconds of the user's input audio, run on in real time
    between chunks. `sent` notes when the input reached `end_ms`; the earliest-arriving chunk
    sets the clock (a late one is jitter), a sender that falls behind is followed slowly, and
    one that stopped sending (over RESYNC_S late) at once. Before any input it stands at
    `start_ms`."""

    def __init__(self, start_ms: float = 0.0) -> None:
        self.start_ms = start_ms
        self.anchor: float | None = None  # the time at which the input clock was 0
        self.last_at = 0.0

    def ms(self, now: float) -> float:
        """The clock at time `now` (perf_counter seconds)."""
        return self.start_ms if self.anchor is None else (now - self.anchor) * 1000

    def sent(self, end_ms: float, now: float) -> None:
        candidate = now - end_ms / 1000
        anchor = self.anchor
        if anchor is None or candidate < anchor or candidate - anchor > RESYNC_S:
            self.anchor = candidate
        else:
            self.anchor = min(candidate, anchor + (now - self.last_at) * RELAX_PER_S)
        self.last_at = now


@dataclass
class _Run:
    """One key's audio: its resampler, where its outputs lie (stretches of (first output,
    timeline position)), and the output from which it was cut (None: not cut)."""

    rate: int
    resampler: Any
    channel: int
    n_in: int = 0
    n_out: int = 0
    stretches: list[tuple[int, int]] = field(default_factory=list)
    cut_at: int | None = None

    def position(self, k: int) -> int:
        first, pos = self.stretches[-1]
        return pos + k - first


@dataclass
class _Piece:
    channel: int
    key: str
    pos: int  # timeline position of its first sample
    first: int  # the run's output index of its first sample
    samples: np.ndarray  # float32 at RATE


class Timeline:
    """Two channels (0 left, 1 right) on one clock of RATE samples; see the module's docstring.
    Not thread safe: one thread owns it."""

    def __init__(self, make_resampler: Callable[[int, int], Any]) -> None:
        self._make_resampler = make_resampler
        self._runs: dict[str, _Run] = {}
        self._pieces: list[_Piece] = []
        self.taken = 0  # samples taken so far: the start of what can still change
        self.late = 0  # samples that came for a place already taken (dropped)

    @property
    def end(self) -> int:
        """The end of the audio laid so far."""
        return max([self.taken, *(p.pos + p.samples.size for p in self._pieces)])

    def add(self, channel: int, key: str, samples: np.ndarray, rate: int, at: int | None = None) -> None:
        """Float32 mono `samples` at `rate` Hz continue run `key` on `channel`; `at` (a timeline
        position): not before it (a new run starts there; without it, at the timeline's end). A
        run whose rate changes starts over (its old resampler's tail is laid first)."""
        run = self._runs.get(key)
        if run is not None and run.rate != rate:
            self.finish(key)
            run = None
        if run is None:
            run = self._runs[key] = _Run(rate, self._make_resampler(rate, RATE), channel)
            run.stretches.append((0, self.end if at is None else at))
        else:
            k0 = run.n_in * RATE // rate
            if at is not None and at > run.position(k0) + RATE // 1000:  # came later than its place: a gap
                run.stretches.append((k0, at))
        run.n_in += samples.size
        self._lay(channel, key, run, run.resampler.process(samples))

    def finish(self, key: str, channel: int | None = None) -> None:
        """Run `key` ended: its resampler's tail is laid (on `channel`, else dropped) and the
        key may start a new run."""
        run = self._runs.pop(key, None)
        if run is not None and channel is not None:
            self._lay(channel, key, run, run.resampler.flush())

    def finish_all(self) -> None:
        """Every run ended (the recording's end): their resamplers' tails are laid."""
        for key, run in list(self._runs.items()):
            self.finish(key, run.channel)

    def _lay(self, channel: int, key: str, run: _Run, out: np.ndarray) -> None:
        k, end = run.n_out, run.n_out + out.size
        run.n_out = end
        if run.cut_at is not None:
            out = out[:max(0, run.cut_at - k)]
        for n, (first, pos) in enumerate(run.stretches):
            stop = run.stretches[n + 1][0] if n + 1 < len(run.stretches) else end
            lo, hi = max(k, first), min(end, stop)
            if lo < hi and lo - k < out.size:
                self._place(_Piece(channel, key, pos + lo - first, lo, out[lo - k:hi - k]))

    def _place(self, piece: _Piece) -> None:
        if piece.pos < self.taken:  # its start is taken already: what remains goes on
            skip = self.taken - piece.pos
            self.late += min(skip, piece.samples.size)
            piece.samples, piece.first, piece.pos = piece.samples[skip:], piece.first + skip, self.taken
        if piece.samples.size:
            self._pieces.append(piece)

    def cut(self, key: str, heard: int) -> int:
        """Run `key` was heard only up to its `heard`-th output sample: the rest goes (what is
        still here of it) and what comes later of it is dropped. Returns the samples removed."""
        run = self._runs.get(key)
        if run is not None:
            run.cut_at = heard if run.cut_at is None else min(run.cut_at, heard)
        removed = 0
        kept: list[_Piece] = []
        for p in self._pieces:
            if p.key == key and p.first + p.samples.size > heard:
                keep = max(0, heard - p.first)
                removed += p.samples.size - keep
                p.samples = p.samples[:keep]
            if p.samples.size:
                kept.append(p)
        self._pieces = kept
        return removed

    def cut_from(self, key: str, at: int) -> int:
        """Run `key` was heard up to timeline position `at` (the listener stopped hearing it
        then): `cut` at the run's output that lies there."""
        run = self._runs.get(key)
        heard = None
        if run is not None:
            for n, (first, pos) in enumerate(run.stretches):
                if pos <= at:  # (in a gap before the next stretch: all of this one was heard)
                    following = run.stretches[n + 1][0] if n + 1 < len(run.stretches) else first + at - pos
                    heard = min(first + at - pos, following)
        if heard is None:  # the run is gone (it ended): its audio lies in its pieces
            starts = [p.first + at - p.pos for p in self._pieces if p.key == key and p.pos <= at]
            heard = max(starts) if starts else 0
            if not any(p.key == key for p in self._pieces):
                return 0
        return self.cut(key, max(0, heard))

    def due(self, input_end: int, limit: int | None = None) -> int:
        """Where to `take` to now that the input reached `input_end`: HOLD_MS behind it (time for a
        cut to come), at most `limit`, once WRITE_EVERY_MS more is ready; 0 while not due."""
        upto = input_end - HOLD_MS * RATE // 1000
        if limit is not None:
            upto = min(upto, limit)
        return upto if upto - self.taken >= WRITE_EVERY_MS * RATE // 1000 else 0

    def take(self, upto: int) -> np.ndarray:
        """The mixed int16 stereo samples from `taken` to `upto`, shape (n, 2); they can no
        longer change."""
        n = upto - self.taken
        if n <= 0:
            return np.zeros((0, 2), np.int16)
        mix = np.zeros((n, 2), np.float32)
        kept: list[_Piece] = []
        for p in self._pieces:
            lo = p.pos - self.taken
            if lo < n:
                m = min(p.samples.size, n - lo)
                mix[lo:lo + m, p.channel] += p.samples[:m]
                p.samples, p.first, p.pos = p.samples[m:], p.first + m, p.pos + m
            if p.samples.size:
                kept.append(p)
        self._pieces = kept
        self.taken = upto
        return to_int16(mix)


def to_int16(x: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as int16 (clipped)."""
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)


def open_private(path: str | os.PathLike[str], replace: bool = False) -> int:
    """A new file at `path` that only its owner may read and write (0600), as a write-only
    descriptor; FileExistsError if it exists, unless `replace` (then it is emptied, and made 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | (os.O_TRUNC if replace else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    if replace:
        os.fchmod(fd, 0o600)
    return fd
