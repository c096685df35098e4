"""Session audio input: a bounded inbox on the loop, everything else in the VAD tick.

Per incoming chunk the event loop does constant work: `AudioInput.append`
checks the byte count and appends to a bytearray. Every 32 ms the VAD tick
lane takes the inboxes of all sessions that have input (`collect`), and in
its thread decodes, resamples to 16 kHz, cuts 512-sample windows, runs ONE
batched Silero call over every session's windows, and feeds each session's
turn detector (`process`). The results go back to the sessions on the loop
as ordered actions (`deliver`):

    ("started", audio_start_ms)   speech started (server_vad, semantic_vad)
    ("audio", (offset_ms, pcm))   turn audio for the recogniser (16 kHz PCM16), prefix
                                  padding included, trailing silence cut to 160 ms;
                                  offset_ms: where it starts in the input
    ("pause", None)               the turn's speech paused: the recogniser has had all of
                                  its audio but for held trailing silence (sent if speech
                                  resumes); once per pause, before speech_stopped
    ("candidate", (silence_ms, audio_end_ms))
                                  semantic_vad: the pause that began at audio_end_ms has lasted
                                  silence_ms, a point to score the words at (`end_turn`)
    ("stopped", Stop)             the turn ended
    ("marker", callback)          a commit or response.create queued behind the input

Noise reduction (`SessionSettings.noise_reduction`): the session opens a suppressor stream off the
loop and hands it over with `denoise`; the tick runs each such input's windows through it, and the
VAD hears the denoised windows while the recogniser gets the input as it came (the measurements
found Whisper no better on denoised audio; BENCHMARKS.md). The VAD's verdicts lag the audio by
the suppressor's delay (16 to 41 ms).

The session ends a semantic_vad turn with `end_turn`: the next tick stops the turn if its
pause is still the same (speech that resumed meanwhile continues the turn).

Sessions without VAD (manual, none) get all their audio as turn audio, unless
transcription is off: then nothing uses it, and the tick only counts it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rtmedia.engines.audio.denoise import Denoiser, DenoiseStream
from rtmedia.engines.audio.resample import (
    alaw_to_float,
    float_to_pcm16,
    make_resampler,
    pcm16_to_float,
    ulaw_to_float,
)
from rtmedia.engines.vad.silero import WINDOW, VadEngine, VadStream
from rtmedia.protocol.turn_kinds import SEMANTIC_VAD
from rtmedia.server.hearing.turns import WINDOW_MS as TURN_WINDOW_MS
from rtmedia.server.hearing.turns import TurnDetector, candidate_points
from rtmedia.server.session.config import ALAW, PCM16, ULAW, SessionSettings
from rtmedia.v1 import realtime_pb2

RATE = 16000
WINDOW_MS = WINDOW * 1000 // RATE
HISTORY_SAMPLES = 2 * RATE  # prefix padding is at most 2000 ms
TRAILING_SILENCE_MS = 160  # of a turn's trailing silence, the recogniser gets this much
DECODERS = {PCM16: pcm16_to_float, ULAW: ulaw_to_float, ALAW: alaw_to_float}
BYTES_PER_SAMPLE = {PCM16: 2, ULAW: 1, ALAW: 1}

Action = tuple[str, Any]
_EMPTY = np.zeros(0, np.float32)


@dataclass(frozen=True, slots=True)
class Overflow:
    """An append that did not fit the inbox (`AudioInput.append`): the ms of audio it discarded
    (with VAD: what was queued before it, and the chunk too when it alone is over the bound),
    and whether the chunk itself was queued (without VAD it is refused whole, and nothing
    queued is discarded)."""

    discarded_ms: int
    chunk_kept: bool


@dataclass(frozen=True, slots=True)
class Stop:
    """A turn's end: where its speech ended, why (silence, semantic, max_wait), the end-of-turn
    score it ended on (semantic), and the silence waited before it ended."""

    audio_end_ms: int
    reason: str = "silence"
    score: float | None = None
    silence_ms: int = 0

    @property
    def proto_reason(self) -> int:
        """The reason as input_audio_buffer.speech_stopped carries it."""
        return TURN_END_REASONS[self.reason]


TURN_END_REASONS = {"silence": realtime_pb2.TURN_END_REASON_SILENCE,
                    "semantic": realtime_pb2.TURN_END_REASON_SEMANTIC,
                    "max_wait": realtime_pb2.TURN_END_REASON_MAX_WAIT}


def recognizer_pcm(data: bytes, encoding: int, rate: int) -> bytes:
    """Whole-clip input audio (a conversation.item.create audio item, in the session's input
    format) as the recogniser takes it: 16 kHz PCM16. Not on the event loop: it resamples."""
    resampler = make_resampler(rate, RATE)
    samples = DECODERS[encoding](data)
    return float_to_pcm16(np.concatenate([resampler.process(samples), resampler.flush()]))


@dataclass
class _Frontend:
    """Thread-owned state: decoder, resampler, window buffer, VAD row, turn detector."""

    settings: SessionSettings
    vad: VadStream | None
    detector: TurnDetector | None
    resampler: Any = None
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # The latest windowed audio, oldest block first: HISTORY_SAMPLES at least once that much came.
    history: list[np.ndarray] = field(default_factory=list)
    history_len: int = 0
    samples: int = 0  # 16 kHz samples taken in (VAD: in whole windows)
    detector_settings: SessionSettings | None = None  # the settings the detector runs on
    held: np.ndarray = field(default_factory=lambda: _EMPTY)  # turn audio not sent yet (see _turn_windows)
    held_ms: int = 0  # where `held` starts in the input
    paused: bool = False  # "pause" was said for the silence now held
    stop: Stop | None = None  # the session's end_turn, applied at the next tick
    denoiser_next: tuple[DenoiseStream | None] | None = None  # AudioInput.denoise's, for this tick

    def __post_init__(self) -> None:
        self.resampler = make_resampler(self.settings.input_rate, RATE)

    def remember(self, block: np.ndarray) -> None:
        self.history.append(block)
        self.history_len += len(block)
        while self.history_len - len(self.history[0]) >= HISTORY_SAMPLES:
            self.history_len -= len(self.history.pop(0))

    def before(self, block: np.ndarray, lo: int, count: int) -> np.ndarray:
        """The `count` samples before sample `lo` of `block`, which follows the history
        (called once per turn start, so joining the history is cheap enough)."""
        return np.concatenate([*self.history, block[:lo]])[self.history_len + lo - count:]


class AudioInput:
    """One session's input path. The loop calls `append`, `clear` and `reconfigure`;
    the VAD tick thread owns the frontend."""

    def __init__(self, settings: SessionSettings, inbox_ms: int, deliver: Callable[[list[Action]], None],
                 vad: VadStream | None,
                 make_detector: Callable[[SessionSettings], TurnDetector] | None = None) -> None:
        """`make_detector` builds the turn detector of a `server_vad` frontend (default: a
        `TurnDetector` on the settings' threshold, padding and silence)."""
        self.deliver = deliver
        self._make_detector = make_detector or _turn_detector
        self.inbox = bytearray()
        self.inbox_ms = inbox_ms
        self._settings = settings
        self._vad_stream = vad
        self._next: _Frontend | None = None  # replaces the frontend at the next tick
        self._stop: Stop | None = None  # end_turn's request, for the next tick
        self._frontend = self._make_frontend(settings)
        self.denoiser: DenoiseStream | None = None  # the tick's (see `denoise`)
        self._denoiser_next: tuple[DenoiseStream | None] | None = None  # handed over at the next tick
        self.orphans: list[DenoiseStream] = []  # replaced before a tick took them: the tick closes them
        self.collected_at = 0.0  # perf_counter when the tick last took this inbox
        # Input frozen by a marker (commit), each followed by its callback.
        self.segments: list[tuple[bytes, Callable[[], None]]] = []

    def _make_frontend(self, settings: SessionSettings) -> _Frontend:
        detector = None
        if settings.vad_turns and self._vad_stream is not None:
            self._vad_stream.reset()
            detector = self._make_detector(settings)
        return _Frontend(settings, self._vad_stream if detector else None, detector)

    @property
    def transcribing(self) -> bool:
        """The session's current transcription setting (read by the tick thread: a
        session.update turning it on takes effect at the next tick)."""
        return self._settings.transcription

    @property
    def bytes_per_ms(self) -> float:
        return self._settings.input_rate * BYTES_PER_SAMPLE[self._settings.input_encoding] / 1000

    # ---- loop side -------------------------------------------------------
    def append(self, data: bytes) -> Overflow | None:
        """Queue input; None when the chunk was queued with nothing lost, else what the overflow
        cost. With VAD the inbox bounds how far the input may run ahead of the turn detector, which
        must keep pace with the speaker: the queued audio is discarded and the new chunk kept,
        unless it alone is too big. Without VAD (manual, none) nothing has to keep pace: a chunk is
        queued whole, whatever its size, while the audio queued before it is within the bound, and
        refused whole (nothing queued is discarded) once the tick has fallen that far behind; the
        inbox then never holds more than the bound and one message. Only whole samples: the VAD
        tick decodes every input's inbox in one step, so a broken one would fail the tick for all
        (callers check a client's audio first and name its mistake)."""
        if len(data) % BYTES_PER_SAMPLE[self._settings.input_encoding]:
            raise ValueError(f"{len(data)} bytes of {self._settings.input_encoding} audio are not whole samples")
        limit = self.inbox_ms * self.bytes_per_ms
        if len(self.inbox) + len(data) <= limit or (not self._settings.vad_turns and len(self.inbox) < limit):
            self.inbox += data
            return None
        if not self._settings.vad_turns:
            return Overflow(0, chunk_kept=False)
        dropped = len(self.inbox)
        self.inbox.clear()
        kept = len(data) <= limit
        if kept:
            self.inbox += data
        else:
            dropped += len(data)
        return Overflow(max(1, round(dropped / self.bytes_per_ms)), kept)

    def reconfigure(self, settings: SessionSettings, reset: bool) -> None:
        """New settings from session.update. Turn parameters change live; a new input
        format or turn type (or `reset`) starts a fresh frontend at the next tick."""
        old, self._settings = self._settings, settings
        if reset or old.input_format != settings.input_format or old.turn_type != settings.turn_type:
            self._next = self._make_frontend(settings)
        elif self._next is not None:
            # A new frontend is still waiting for its tick: keep it (with these settings),
            # or the session would go on decoding audio in the previous format.
            self._next = self._make_frontend(settings)
        elif self._frontend.detector is not None:
            self._frontend.settings = settings

    @property
    def pending_denoiser(self) -> tuple[DenoiseStream | None] | None:
        """A suppressor handed over but not taken by a tick yet."""
        return self._denoiser_next or self._frontend.denoiser_next

    def denoise(self, stream: DenoiseStream | None) -> None:
        """The suppressor stream the VAD's audio goes through from the next tick (None: off);
        the tick closes the one it replaces."""
        if self._denoiser_next is not None and self._denoiser_next[0] is not None:
            self.orphans.append(self._denoiser_next[0])  # handed over, never taken
        self._denoiser_next = (stream,)

    def clear(self) -> int:
        """Drop queued and buffered input (input_audio_buffer.clear); returns the ms dropped.
        Markers already queued still run, after the input before them."""
        dropped = round(len(self.inbox) / self.bytes_per_ms)
        self.inbox.clear()
        self._next = self._make_frontend(self._settings)
        return dropped

    def end_turn(self, stop: Stop) -> None:
        """semantic_vad: end the turn whose pause began at `stop.audio_end_ms`, at the next tick,
        unless speech resumed first."""
        self._stop = stop

    @property
    def has_work(self) -> bool:
        return bool(self.inbox or self.segments or self._stop)

    def after_input(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop once the input queued so far (and nothing sent
        after this call) has been delivered."""
        self.segments.append((bytes(self.inbox), callback))
        self.inbox.clear()

    def take(self) -> tuple[list[tuple[bytes, Callable[[], None] | None]], _Frontend]:
        segments: list[tuple[bytes, Callable[[], None] | None]] = [*self.segments, (bytes(self.inbox), None)]
        self.segments = []
        self.inbox.clear()
        if self._next is not None:
            self._frontend, self._next = self._next, None
        if self._stop is not None:
            self._frontend.stop, self._stop = self._stop, None
        if self._denoiser_next is not None:
            self._frontend.denoiser_next, self._denoiser_next = self._denoiser_next, None
        self.collected_at = time.perf_counter()
        return segments, self._frontend


def _turn_detector(settings: SessionSettings) -> TurnDetector:
    detector = TurnDetector(settings.threshold, settings.prefix_padding_ms, settings.silence_duration_ms)
    _tune(detector, settings)
    return detector


def _tune(detector: TurnDetector, settings: SessionSettings) -> None:
    """semantic_vad: the detector ends a turn itself only at the longest wait, and reports the
    candidate points of each pause on the way."""
    semantic = settings.turn_type == SEMANTIC_VAD
    if semantic:
        detector.silence_duration_ms = settings.turn_wait_ms  # (up to 30 s: past server_vad's bounds)
    detector.candidates_ms = candidate_points(settings) if semantic else ()


class VadTick:
    """The VAD tick lane's collect / process / deliver over all registered inputs."""

    def __init__(self, engine: VadEngine, denoiser: Denoiser | None = None) -> None:
        self.engine = engine
        self.denoiser = denoiser or Denoiser()
        self.inputs: set[AudioInput] = set()
        self.retired: deque[DenoiseStream] = deque()  # detached inputs' suppressors, closed by the next tick
        self.wake: Callable[[], None] = lambda: None  # the tick lane's: step now (server/lanes/scheduler.py)

    def collect(self) -> list[tuple[AudioInput, list[tuple[bytes, Callable[[], None] | None]], _Frontend]]:
        return [(inp, *inp.take()) for inp in self.inputs if inp.has_work]

    def process(self, work: list[tuple[AudioInput, list[tuple[bytes, Callable[[], None] | None]], _Frontend]]
                ) -> list[tuple[AudioInput, list[Action]]]:
        while self.retired:  # (no step uses them any more: the step before this one has ended)
            self.denoiser.close_stream(self.retired.popleft())
        blocks: list[tuple[int, np.ndarray]] = []  # (work index, the input's whole windows of this tick)
        actions: list[list[Action]] = []
        for n, (inp, segments, fe) in enumerate(work):
            if fe.denoiser_next is not None:
                (stream,), fe.denoiser_next = fe.denoiser_next, None
                while inp.orphans:
                    self.denoiser.close_stream(inp.orphans.pop())
                if inp.denoiser is not None:
                    self.denoiser.close_stream(inp.denoiser)
                inp.denoiser = stream
            decode = DECODERS[fe.settings.input_encoding]
            acts: list[Action] = []
            actions.append(acts)
            if fe.detector is None and not inp.transcribing:  # nothing uses the audio: count it, keep markers
                width, rate = BYTES_PER_SAMPLE[fe.settings.input_encoding], fe.settings.input_rate
                for data, marker in segments:
                    fe.samples += len(data) // width * RATE // rate
                    if marker is not None:
                        acts.append(("marker", marker))
                continue
            if fe.detector is None:  # all input is turn audio, markers in their place
                for data, marker in segments:
                    samples = fe.resampler.process(decode(data))
                    if len(samples):
                        acts.append(("audio", (fe.samples * 1000 // RATE, float_to_pcm16(samples))))
                        fe.samples += len(samples)
                    if marker is not None:
                        acts.append(("marker", marker))
                continue
            samples = fe.resampler.process(decode(b"".join(data for data, _ in segments)))
            fe.pending = np.concatenate([fe.pending, samples])
            count = len(fe.pending) // WINDOW
            if count:
                blocks.append((n, fe.pending[:count * WINDOW]))
                fe.pending = fe.pending[count * WINDOW:]
            elif fe.stop is not None:  # no new window, but the session ended the turn
                _turn_windows(fe, _EMPTY, [], acts, inp.transcribing)
        if blocks:
            heard = [(work[n][2].vad, block if work[n][0].denoiser is None else
                      self.denoiser.process(work[n][0].denoiser, block)) for n, block in blocks]
            probs = self.engine.step_blocks(heard)  # type: ignore[arg-type]
            for (n, block), p in zip(blocks, probs, strict=True):
                inp, _, fe = work[n]
                _turn_windows(fe, block, p.tolist(), actions[n], inp.transcribing)
        for (_, segments, fe), acts in zip(work, actions, strict=True):
            if fe.detector is not None:  # with VAD, markers follow the tick's windows
                acts += [("marker", marker) for _, marker in segments if marker is not None]
        return [(inp, acts) for (inp, _, _), acts in zip(work, actions, strict=True) if acts]

    def deliver(self, results: list[tuple[AudioInput, list[Action]]]) -> None:
        for inp, actions in results:
            if inp in self.inputs:  # not for a session that closed while the step ran
                inp.deliver(actions)


def _turn_windows(fe: _Frontend, block: np.ndarray, probs: list[float], out: list[Action],
                  transcribing: bool) -> None:
    """Feed a block of windows' probabilities to the detector, in order; route their audio
    (one "audio" action per run of turn audio in the block, none when not transcribing).

    A turn's trailing silence beyond TRAILING_SILENCE_MS is held back: sent once speech
    resumes, dropped when the turn ends (the recogniser needs only a little silence after the
    last word, and decoding the rest of the `silence_duration_ms` before speech_stopped is
    CPU spent on nothing). When it starts to be held, a "pause" action says so: the session can have the
    recogniser finish the audio so far before the turn is known to have ended."""
    detector, s = fe.detector, fe.settings
    assert detector is not None
    if fe.detector_settings is not s:
        detector.update(threshold=s.threshold, prefix_padding_ms=s.prefix_padding_ms,
                        silence_duration_ms=s.silence_duration_ms)
        _tune(detector, s)
        fe.detector_settings = s
    natural = "max_wait" if s.turn_type == SEMANTIC_VAD else "silence"
    lo = 0 if detector.in_speech else None  # where this block's unsent turn audio starts

    def send(hi: int, ended: bool) -> None:
        """Turn audio up to sample `hi` of the block, but for held trailing silence."""
        if not transcribing:
            return
        start_ms = fe.held_ms if len(fe.held) else (fe.samples + lo) * 1000 // RATE
        audio = np.concatenate([fe.held, block[lo:hi]]) if len(fe.held) else block[lo:hi]
        quiet = (fe.samples + hi) - detector.voiced_end_ms * RATE // 1000
        keep = max(0, len(audio) - max(0, quiet - TRAILING_SILENCE_MS * RATE // 1000))
        if keep:
            out.append(("audio", (start_ms, float_to_pcm16(audio[:keep]))))
            fe.paused = False
        fe.held = _EMPTY if ended else audio[keep:]
        fe.held_ms = start_ms + keep * 1000 // RATE
        if len(fe.held) and not fe.paused:
            out.append(("pause", None))
            fe.paused = True

    if (stop := fe.stop) is not None:
        fe.stop = None
        resumed = any(not p < detector.low_threshold for p in probs)  # speech came back in this block
        if detector.in_speech and detector.silence_ms and detector.voiced_end_ms == stop.audio_end_ms \
                and not resumed:
            silence = detector.silence_ms
            detector.stop()
            send(0, ended=True)
            lo = None
            out.append(("stopped", Stop(stop.audio_end_ms, stop.reason, stop.score, silence)))
    for j, prob in enumerate(probs):
        at = j * WINDOW
        silence = detector.silence_ms
        event = detector.push(prob)
        if event is not None and event.kind == "speech_started":
            out.append(("started", event.audio_ms))
            pad = min(fe.history_len + at, s.prefix_padding_ms * RATE // 1000)
            fe.held = fe.before(block, at, pad) if transcribing else _EMPTY
            fe.held_ms = (fe.samples + at) * 1000 // RATE - pad * 1000 // RATE
            lo = at
        elif event is not None and event.kind == "pause_candidate":
            out.append(("candidate", (event.audio_ms, detector.voiced_end_ms)))
        elif event is not None:  # speech_stopped: this window is the last of the turn
            assert lo is not None
            send(at + WINDOW, ended=True)
            lo = None
            out.append(("stopped", Stop(event.audio_ms, natural, None, silence + TURN_WINDOW_MS)))
    if lo is not None and len(block):
        send(len(block), ended=False)
    if len(block):
        fe.remember(block)
        fe.samples += len(block)
