"""Server-VAD turn detection (docs/protocol.md#turns): pure logic over one VAD probability per 32 ms window.

Speech starts at the first window whose probability reaches `threshold`;
`audio_ms` of `speech_started` is the start of that window. In speech, a
window below the lower threshold `max(threshold - 0.15, 0.01)` counts as
silence and any other window resets the count (hysteresis: values between
the two thresholds keep a turn going). Once the silence lasts
`silence_duration_ms`, speech stops; `audio_ms` of `speech_stopped` is the end
of the last window that was not silence, i.e. where the silence began, so the
event is reported `silence_duration_ms` (rounded up to whole windows) after
that point. Time is kept in whole windows, so offsets never drift.
The committed turn audio also covers `prefix_padding_ms` before the start
(`turn_audio_bounds`).

semantic_vad runs the same detector with `silence_duration_ms` set to the longest wait
and `candidates_ms`: as a pause's silence reaches each of them, a `pause_candidate` event
(its `audio_ms`: the silence so far) lets the session score the words; `stop()` ends the
turn there when the session so decides (docs/protocol.md#semantic-vad).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

WINDOW_MS = 32  # 512 samples at 16 kHz
LOW_THRESHOLD_GAP = 0.15
LOW_THRESHOLD_FLOOR = 0.01

# Inclusive bounds of each setting, shared with the session's config checks.
BOUNDS: dict[str, tuple[float, float]] = {
    "threshold": (0.05, 0.95),
    "prefix_padding_ms": (0, 2000),
    "silence_duration_ms": (100, 5000),
}


def check_turn_params(**params: float | None) -> None:
    """Raise ValueError naming the field and its bounds for the first setting out of bounds.

    Settings given as None are skipped; the `*_ms` settings must be whole numbers.
    """
    for name, value in params.items():
        if value is None:
            continue
        if name not in BOUNDS:
            raise ValueError(f"turn_detection.{name} is not a turn detection setting")
        lo, hi = BOUNDS[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"turn_detection.{name}={value!r} is not a number")
        if name.endswith("_ms") and not (isinstance(value, int) or value.is_integer()):
            raise ValueError(f"turn_detection.{name}={value} is not a whole number of ms")
        if not lo <= value <= hi:  # NaN fails here too
            raise ValueError(f"turn_detection.{name}={value} is outside {lo}..{hi}")


# semantic_vad scores a pause again as its silence reaches these (docs/protocol.md#semantic-vad).
RESCORE_MS = (600, 1500)


def candidate_points(settings: Any) -> tuple[int, ...]:
    """A semantic_vad pause's candidate points (ms of silence): the first (candidate_ms), the
    rescores, and server_vad's silence_duration_ms (where a pause no score could be had for
    ends), each before the longest wait."""
    first = settings.candidate_ms
    points = {first, settings.silence_duration_ms, *(ms for ms in RESCORE_MS if ms > first)}
    return tuple(sorted(ms for ms in points if first <= ms < settings.turn_wait_ms))


@dataclass(frozen=True, slots=True)
class TurnEvent:
    """A turn boundary; `audio_ms` is the offset in the stream's input audio."""

    kind: Literal["speech_started", "speech_stopped", "pause_candidate"]
    audio_ms: int


class TurnDetector:
    """Turns speech probabilities, one per 32 ms window in order, into start/stop events."""

    def __init__(
        self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500
    ) -> None:
        check_turn_params(
            threshold=threshold, prefix_padding_ms=prefix_padding_ms, silence_duration_ms=silence_duration_ms
        )
        self.threshold = float(threshold)
        self.prefix_padding_ms = int(prefix_padding_ms)
        self.silence_duration_ms = int(silence_duration_ms)
        self.candidates_ms: tuple[int, ...] = ()
        self.reset()

    def reset(self) -> None:
        """Back to no speech at time zero (the settings are kept)."""
        self._windows = 0  # windows pushed so far
        self._start: int | None = None  # window index where the current turn started
        self._voiced_end = 0  # windows up to the end of the last non-silent window of the turn
        self._silent = 0  # consecutive silent windows in the current turn

    def update(
        self,
        threshold: float | None = None,
        prefix_padding_ms: int | None = None,
        silence_duration_ms: int | None = None,
    ) -> None:
        """Change settings (None keeps one); they apply from the next window pushed."""
        check_turn_params(
            threshold=threshold, prefix_padding_ms=prefix_padding_ms, silence_duration_ms=silence_duration_ms
        )
        if threshold is not None:
            self.threshold = float(threshold)
        if prefix_padding_ms is not None:
            self.prefix_padding_ms = int(prefix_padding_ms)
        if silence_duration_ms is not None:
            self.silence_duration_ms = int(silence_duration_ms)

    @property
    def low_threshold(self) -> float:
        """Below this a window counts as silence during speech."""
        return max(self.threshold - LOW_THRESHOLD_GAP, LOW_THRESHOLD_FLOOR)

    @property
    def in_speech(self) -> bool:
        return self._start is not None

    @property
    def windows_seen(self) -> int:
        return self._windows

    @property
    def now_ms(self) -> int:
        """Milliseconds of audio processed so far."""
        return self._windows * WINDOW_MS

    @property
    def voiced_end_ms(self) -> int:
        """End of the current (or last) turn's last window that was not silence."""
        return self._voiced_end * WINDOW_MS

    @property
    def speech_start_ms(self) -> int | None:
        """`audio_ms` of the current turn's start, or None outside speech."""
        return None if self._start is None else self._start * WINDOW_MS

    def push(self, prob: float) -> TurnEvent | None:
        """Feed the next window's speech probability; returns the event it causes, if any."""
        n = self._windows
        self._windows += 1
        if self._start is None:
            if prob >= self.threshold:
                self._start, self._voiced_end, self._silent = n, n + 1, 0
                return TurnEvent("speech_started", n * WINDOW_MS)
            return None
        if prob >= self.low_threshold:  # (NaN counts as silence, as it never starts speech)
            self._voiced_end, self._silent = n + 1, 0
            return None
        self._silent += 1
        silence = self._silent * WINDOW_MS
        if silence < self.silence_duration_ms:
            if any(silence - WINDOW_MS < c <= silence for c in self.candidates_ms):
                return TurnEvent("pause_candidate", silence)
            return None
        return self.stop()

    @property
    def silence_ms(self) -> int:
        """The current pause's silence so far (0 outside a pause)."""
        return self._silent * WINDOW_MS if self._start is not None else 0

    def stop(self) -> TurnEvent:
        """End the turn now (speech must be in progress): its end is where the silence began."""
        assert self._start is not None
        self._start = None
        return TurnEvent("speech_stopped", self._voiced_end * WINDOW_MS)

    def turn_audio_bounds(self, start_ms: int, end_ms: int) -> tuple[int, int]:
        """Audio of a committed turn: from `prefix_padding_ms` before its start to its end."""
        return max(0, start_ms - self.prefix_padding_ms), end_ms

    @staticmethod
    def silence_windows(silence_duration_ms: int) -> int:
        """Silent windows that end a turn: `silence_duration_ms` rounded up to whole windows."""
        return -(-silence_duration_ms // WINDOW_MS)
