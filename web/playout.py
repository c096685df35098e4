"""Reply playout shared by the doors that pace a session's reply themselves (the WebRTC
bridge's audio track, a SIP call's media port): the "media session <-> Converse" layer.

- `PlayoutBuffer`: reply audio, a bounded FIFO of mono samples at the door's rate tagged with
  the response they belong to. The door's clock takes one 20 ms frame per tick; an empty
  buffer plays silence and counts an underrun; `clear()` (barge-in) drops everything at once.
  It remembers how much of each response was played out.
- `ReplyPlayout`: a session's replies on such a buffer. `on_event` takes the server's events
  that drive playout (audio deltas, resampled to the buffer's rate; `output_audio_buffer.cleared`
  empties it at once; `speech_tentative` holds it while a voice over the reply is judged, until
  `backchannel` or `speech_started`; `response.done`); `acks()` says what to acknowledge
  (`playback.ack`: what the clock has taken, never more than the server sent), so the server
  truncates an interrupted reply at the point the listener heard.

The buffer's clock may run on another thread (a SIP call's media port is pulled by PJSIP's
media clock): every method of `ReplyPlayout` and `pull()` hold `lock`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
from rtmedia.engines.audio.resample import Resampler, float_to_pcm16, make_resampler, pcm16_to_float
from rtmedia.protocol.playback import PlaybackAck
from rtmedia.v1 import realtime_pb2

FRAME_MS = 20
MAX_TRACKED_RESPONSES = 64  # playout positions remembered for acknowledgement


@dataclass
class PlayoutStats:
    frames: int = 0  # frames pulled
    audio_frames: int = 0  # frames that carried some reply audio
    underruns: int = 0  # times a reply ran dry before its end (counted when more of it came)
    cleared: int = 0  # clear() calls that dropped audio
    dropped_samples: int = 0  # samples dropped by clear() or by overflow
    overflow_samples: int = 0  # samples dropped because the buffer was full


class PlayoutBuffer:
    """A bounded FIFO of reply audio (mono, `rate` Hz), with per-response playout positions.

    `push()` appends a response's samples (int16); when more than `max_ms` would be
    queued the oldest samples are dropped and counted. `pull()` takes one frame,
    padding with silence; while `paused` it plays silence and keeps the queue (voice over a
    reply being judged). `clear()` drops what is queued. `played(response_id)`:
    samples of that response pulled so far; `received(response_id)`: samples pushed.
    """

    def __init__(self, rate: int, max_ms: int = 3000) -> None:
        if max_ms <= 0:
            raise ValueError(f"max_ms must be positive, got {max_ms}")
        self.rate = rate
        self.capacity = rate * max_ms // 1000
        self._queue: deque[tuple[str, np.ndarray]] = deque()  # (response_id, samples), front partly played
        self._offset = 0  # samples of the front segment already played
        self._queued = 0
        self._played: OrderedDict[str, int] = OrderedDict()
        self._received: dict[str, int] = {}
        self._last = ""  # the response of the last sample played
        self._dry: str | None = None  # the response that ran dry mid-frame (its end, or an underrun)
        self.paused = False
        self.arrived = asyncio.Event()  # set by push(): audio is queued
        self.stats = PlayoutStats()

    @property
    def queued_samples(self) -> int:
        return self._queued

    @property
    def queued_ms(self) -> float:
        return self._queued * 1000 / self.rate

    def played(self, response_id: str) -> int:
        return self._played.get(response_id, 0)

    def received(self, response_id: str) -> int:
        return self._received.get(response_id, 0)

    def holds(self, response_id: str) -> bool:
        """Some of the response's audio is still queued."""
        return any(rid == response_id for rid, _ in self._queue)

    def responses(self) -> list[str]:
        """Responses with a playout position, oldest first."""
        return list(self._played)

    def push(self, response_id: str, samples: np.ndarray) -> None:
        samples = np.asarray(samples)
        if samples.dtype != np.int16 or samples.ndim != 1:
            raise ValueError(f"expected mono int16 samples, got {samples.dtype} with shape {samples.shape}")
        if not len(samples):
            return
        if response_id not in self._played:
            self._played[response_id] = 0
            while len(self._played) > MAX_TRACKED_RESPONSES:
                old, _ = self._played.popitem(last=False)
                self._received.pop(old, None)
        self._received[response_id] = self._received.get(response_id, 0) + len(samples)
        if self._dry == response_id:  # more of a response that had run dry: the listener heard a gap
            self.stats.underruns += 1
        self._dry = None
        self._queue.append((response_id, samples))
        self._queued += len(samples)
        self.arrived.set()
        excess = self._queued - self.capacity
        if excess > 0:
            self._drop(excess)
            self.stats.overflow_samples += excess

    def _drop(self, count: int) -> None:
        """Drop `count` samples from the front (counted as dropped, not played)."""
        self.stats.dropped_samples += count
        while count > 0 and self._queue:
            _, seg = self._queue[0]
            left = len(seg) - self._offset
            if left <= count:
                self._queue.popleft()
                self._offset = 0
                self._queued -= left
                count -= left
            else:
                self._offset += count
                self._queued -= count
                count = 0

    def pull(self, n: int | None = None) -> np.ndarray:
        """The next `n` samples (default a 20 ms frame): queued audio, then silence."""
        n = n or self.rate * FRAME_MS // 1000
        out = np.zeros(n, np.int16)
        filled = 0
        while filled < n and self._queue and not self.paused:
            rid, seg = self._queue[0]
            take = min(n - filled, len(seg) - self._offset)
            out[filled:filled + take] = seg[self._offset:self._offset + take]
            filled += take
            self._offset += take
            self._queued -= take
            if rid in self._played:
                self._played[rid] += take
            self._last = rid
            if self._offset == len(seg):
                self._queue.popleft()
                self._offset = 0
        self.stats.frames += 1
        if filled:
            self.stats.audio_frames += 1
        if filled < n and not self.paused and self._last:
            self._dry, self._last = self._last, ""  # ran dry: an underrun if more of this response comes
        return out

    def clear(self) -> int:
        """Drop everything queued at once (barge-in); returns the samples dropped."""
        dropped = self._queued
        if dropped:
            self._drop(dropped)
            self.stats.cleared += 1
        self._queue.clear()
        self._offset = self._queued = 0
        self._dry = None
        return dropped


@dataclass
class ReplyState:
    rate: int  # the server's rate of this reply
    samples: int = 0  # at the server's rate, as it counts what it sent
    ack: PlaybackAck = field(default_factory=PlaybackAck)
    done: bool = False
    resampler: Resampler | None = None

    @property
    def sent_ms(self) -> int:
        return self.samples * 1000 // self.rate


@dataclass
class Cleared:
    """What a barge-in's `output_audio_buffer.cleared` did to the playout."""

    response_id: str
    dropped_ms: int
    played_ms: int


@dataclass
class ReplyPlayout:
    """The replies of one session on one `PlayoutBuffer` (see the module docstring)."""

    rate: int
    max_ms: int = 3000
    buffer: PlayoutBuffer = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)
    replies: dict[str, ReplyState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buffer = PlayoutBuffer(self.rate, self.max_ms)

    def pull(self, n: int) -> np.ndarray:
        with self.lock:
            return self.buffer.pull(n)

    def on_event(self, msg: realtime_pb2.ConverseResponse) -> Cleared | None:
        """Apply a server event to the playout; a barge-in's clear returns what it did."""
        kind = msg.WhichOneof("event")
        with self.lock:
            if kind == "response_output_audio_delta":
                self._push(msg.response_output_audio_delta)
            elif kind == "output_audio_buffer_cleared":
                # Barge-in: drop queued audio first, so not one more frame of it is played.
                rid = msg.output_audio_buffer_cleared.response_id
                dropped = self.buffer.clear()
                self.buffer.paused = False
                if rid in self.replies:
                    self.replies[rid].done = True
                return Cleared(rid, dropped * 1000 // self.rate, self.buffer.played(rid) * 1000 // self.rate)
            elif kind == "input_audio_buffer_speech_tentative":
                self.buffer.paused = True  # confirmed interruptions: hold the reply while the voice is judged
            elif kind in ("input_audio_buffer_backchannel", "input_audio_buffer_speech_started"):
                self.buffer.paused = False  # judged: it goes on (a cancel's cleared follows an interruption)
            elif kind == "response_done" and (reply := self.replies.get(msg.response_done.response_id)):
                reply.done = True
        return None

    def _push(self, ev: realtime_pb2.ResponseOutputAudioDeltaEvent) -> None:
        reply = self.replies.get(ev.response_id)
        if reply is None:
            reply = self.replies[ev.response_id] = ReplyState(ev.sample_rate or self.rate)
        channels = max(1, ev.channels)
        samples = np.frombuffer(ev.audio[: len(ev.audio) // (2 * channels) * 2 * channels], "<i2")
        if channels > 1:
            samples = samples.reshape(-1, channels).mean(axis=1).astype(np.int16)
        reply.samples += len(samples)
        if reply.rate != self.rate:
            if reply.resampler is None:
                reply.resampler = make_resampler(reply.rate, self.rate)
            samples = np.frombuffer(float_to_pcm16(reply.resampler.process(pcm16_to_float(samples.tobytes()))),
                                    "<i2")
        self.buffer.push(ev.response_id, samples.astype(np.int16))

    def acks(self) -> tuple[list[tuple[str, int]], list[str]]:
        """The `playback.ack`s due, (response_id, played_ms), by `PlaybackAck`: every ACK_EVERY_MS of
        played audio and once a reply has played out (or was cut); and the replies that finished
        playing (forgotten from now on)."""
        due: list[tuple[str, int]] = []
        finished: list[str] = []
        with self.lock:
            for rid, reply in list(self.replies.items()):
                played = min(self.buffer.played(rid) * 1000 // self.rate, reply.sent_ms)
                over = reply.done and not self.buffer.holds(rid)
                ack = reply.ack.due(played, over)
                if ack is not None:
                    due.append((rid, ack))
                if over and played >= reply.ack.acked_ms:
                    del self.replies[rid]
                    finished.append(rid)
        return due, finished

    def playing(self) -> bool:
        """Some reply audio is queued or still to come."""
        with self.lock:
            return self.buffer.queued_samples > 0 or any(not r.done for r in self.replies.values())
