"""History-window endpointing (NVIDIA Riva's `EndpointingConfig`) over the VAD's 32 ms windows.

Riva decides on the acoustic model's blank frames; rtmedia decides on Silero
VAD windows instead. The mapping:

- a window is *voiced* when its speech probability reaches `threshold` (0.5,
  Silero's usual cut) and *blank* otherwise;
- `start_history` ms become `ceil(start_history / 32)` windows; outside speech,
  an utterance starts once at least `start_threshold` of the last that many
  windows are voiced (at the start of a stream, of the windows seen so far).
  Its start is the first voiced window among them;
- `stop_history` ms become `ceil(stop_history / 32)` windows; in speech, the
  utterance ends once at least `stop_threshold` of the last that many windows
  (since it started) are blank. Its end is the end of its last voiced window.

Since a start is only known `start_history` after the fact, the turn audio
handed on carries `start_history + START_MARGIN_MS` of audio from before the
deciding window (`prefix_padding_ms`), so the first word is never clipped.
"""

from __future__ import annotations

import math
from collections import deque

from rtmedia.server.hearing.turns import WINDOW_MS, TurnDetector, TurnEvent

VOICED_THRESHOLD = 0.5
START_MARGIN_MS = 250
# Riva's own defaults (its streaming ASR pipelines' endpointing settings).
DEFAULTS = {"start_history": 300, "start_threshold": 0.2, "stop_history": 800, "stop_threshold": 0.98}
# Inclusive bounds; `*_history` in ms. A start needs its history in the 2 s kept before a turn.
BOUNDS: dict[str, tuple[float, float]] = {
    "start_history": (WINDOW_MS, 1600),
    "start_threshold": (0.01, 1.0),
    "stop_history": (WINDOW_MS, 5000),
    "stop_threshold": (0.01, 1.0),
}


def check_endpointing(**params: float) -> None:
    """ValueError naming the first setting outside BOUNDS."""
    for name, value in params.items():
        lo, hi = BOUNDS[name]
        if not lo <= value <= hi:  # NaN fails too
            raise ValueError(f"endpointing_config.{name}={value:g} is outside {lo:g}..{hi:g}")


def _needed(fraction: float, windows: int) -> int:
    """Windows out of `windows` that make up `fraction` of them (at least one)."""
    return max(1, math.ceil(fraction * windows - 1e-9))


class HistoryEndpointer(TurnDetector):
    """A `TurnDetector` whose starts and stops follow Riva's endpointing rule (module docstring).
    The base class's `threshold` is the voiced cut; `prefix_padding_ms` and
    `silence_duration_ms` describe the turn audio and stop delay for its callers."""

    def __init__(self, start_history: int = 300, start_threshold: float = 0.2, stop_history: int = 800,
                 stop_threshold: float = 0.98) -> None:
        check_endpointing(start_history=start_history, start_threshold=start_threshold,
                          stop_history=stop_history, stop_threshold=stop_threshold)
        self.start_windows = math.ceil(start_history / WINDOW_MS)
        self.stop_windows = math.ceil(stop_history / WINDOW_MS)
        self.start_needed = _needed(start_threshold, self.start_windows)
        self.stop_needed = _needed(stop_threshold, self.stop_windows)
        super().__init__(VOICED_THRESHOLD, self.start_windows * WINDOW_MS + START_MARGIN_MS,
                         min(max(self.stop_windows * WINDOW_MS, 100), 5000))

    def reset(self) -> None:
        super().reset()
        self._recent: deque[bool] = deque(maxlen=self.start_windows)  # voiced flags, outside speech
        self._tail: deque[bool] = deque(maxlen=self.stop_windows)  # blank flags, in speech

    def push(self, prob: float) -> TurnEvent | None:
        n = self._windows
        self._windows += 1
        voiced = prob >= self.threshold  # NaN is blank
        if self._start is None:
            self._recent.append(voiced)
            if sum(self._recent) < self.start_needed:
                return None
            flags, base = list(self._recent), n - len(self._recent) + 1
            first = base + flags.index(True)
            last = base + len(flags) - 1 - flags[::-1].index(True)
            self._start, self._voiced_end = first, last + 1
            self._tail.extend(not v for v in flags[first - base:])
            self._recent.clear()
            return TurnEvent("speech_started", first * WINDOW_MS)
        self._tail.append(not voiced)
        if voiced:
            self._voiced_end = n + 1
            return None
        if sum(self._tail) < self.stop_needed:
            return None
        self._start = None
        self._tail.clear()
        return TurnEvent("speech_stopped", self._voiced_end * WINDOW_MS)
