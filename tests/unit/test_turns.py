"""Server-VAD turn detection (docs/protocol.md#turns) on synthetic probabilities, semantic_vad's candidate
points and stop, and end to end on the real VAD engine with Piper speech."""

from __future__ import annotations

import numpy as np
import pytest
from rtmedia.engines.vad.silero import WINDOW, VadEngine, VadItem
from rtmedia.server.hearing.turns import BOUNDS, WINDOW_MS, TurnDetector, TurnEvent, check_turn_params

from tests.support.speech import Speaker


def _run(det: TurnDetector, probs: list[float]) -> list[tuple[int, TurnEvent]]:
    """(window index, event) for every event the probabilities cause."""
    out = []
    for i, p in enumerate(probs):
        ev = det.push(p)
        if ev is not None:
            out.append((i, ev))
    return out


def test_start_and_stop_offsets_exact() -> None:
    det = TurnDetector()  # 0.5 / 300 / 500: 16 silent windows (512 ms) end a turn
    probs = [0.1] * 10 + [0.5] + [0.9] * 19 + [0.0] * 20
    events = _run(det, probs)
    # Start at window 10 (the probability reaches the threshold exactly); the silence begins at
    # window 30 and the 16th silent window (index 45) reports the stop.
    assert events == [
        (10, TurnEvent("speech_started", 320)),
        (45, TurnEvent("speech_stopped", 960)),
    ]
    assert not det.in_speech
    assert det.windows_seen == 50 and det.now_ms == 1600


def test_just_below_threshold_never_starts() -> None:
    det = TurnDetector(threshold=0.5)
    assert _run(det, [0.4999] * 100) == []
    assert not det.in_speech and det.speech_start_ms is None


def test_hysteresis_between_thresholds_keeps_speech() -> None:
    det = TurnDetector(threshold=0.5)  # low threshold 0.35
    assert det.low_threshold == pytest.approx(0.35)
    events = _run(det, [0.6] + [0.36] * 100 + [0.34] * 16)
    assert events == [
        (0, TurnEvent("speech_started", 0)),
        (116, TurnEvent("speech_stopped", 101 * WINDOW_MS)),
    ]


def test_brief_dips_do_not_split_a_turn() -> None:
    det = TurnDetector(silence_duration_ms=500)
    dip = [0.0] * 15  # 480 ms < 500 ms
    probs = [0.9] * 5 + dip + [0.9] + dip + [0.4] + dip + [0.9] * 3 + [0.0] * 16
    events = _run(det, probs)
    assert [e.kind for _, e in events] == ["speech_started", "speech_stopped"]
    assert events[1][1].audio_ms == (5 + 15 + 1 + 15 + 1 + 15 + 3) * WINDOW_MS


@pytest.mark.parametrize(("silence_ms", "windows"), [(100, 4), (500, 16), (512, 16), (513, 17), (5000, 157)])
def test_silence_rounds_up_to_whole_windows(silence_ms: int, windows: int) -> None:
    assert TurnDetector.silence_windows(silence_ms) == windows
    det = TurnDetector(silence_duration_ms=silence_ms)
    events = _run(det, [0.9] + [0.0] * windows)
    assert events[-1] == (windows, TurnEvent("speech_stopped", WINDOW_MS))


def test_several_turns_and_time_keeps_counting() -> None:
    det = TurnDetector(silence_duration_ms=100)  # 4 windows
    turn = [0.9] * 3 + [0.0] * 4
    events = _run(det, [0.0] * 2 + turn * 3)
    starts = [e.audio_ms for _, e in events if e.kind == "speech_started"]
    stops = [e.audio_ms for _, e in events if e.kind == "speech_stopped"]
    assert starts == [2 * 32, 9 * 32, 16 * 32]
    assert stops == [5 * 32, 12 * 32, 19 * 32]


def test_low_threshold_floor() -> None:
    det = TurnDetector(threshold=0.05)
    assert det.low_threshold == 0.01  # max(0.05 - 0.15, 0.01)
    events = _run(det, [0.05] + [0.01] * 50 + [0.0099] * 16)
    assert events == [(0, TurnEvent("speech_started", 0)), (66, TurnEvent("speech_stopped", 51 * WINDOW_MS))]


def test_updates_take_effect_from_the_next_window() -> None:
    det = TurnDetector(threshold=0.5)
    assert det.push(0.45) is None
    det.update(threshold=0.4)
    assert det.push(0.45) == TurnEvent("speech_started", 32)
    det.update(threshold=0.8)  # low threshold 0.65: 0.6 now counts as silence
    assert det.low_threshold == pytest.approx(0.65)
    assert [det.push(0.6) for _ in range(10)] == [None] * 10
    det.update(silence_duration_ms=320)  # 10 silent windows already: the next one ends the turn
    assert det.push(0.0) == TurnEvent("speech_stopped", 64)
    det.update(prefix_padding_ms=0)
    assert det.turn_audio_bounds(64, 640) == (64, 640)
    assert (det.threshold, det.prefix_padding_ms, det.silence_duration_ms) == (0.8, 0, 320)


def test_turn_audio_bounds_and_reset() -> None:
    det = TurnDetector(prefix_padding_ms=300)
    assert det.turn_audio_bounds(1000, 2000) == (700, 2000)
    assert det.turn_audio_bounds(200, 900) == (0, 900)
    _run(det, [0.9] * 3)
    assert det.in_speech and det.speech_start_ms == 0
    det.reset()
    assert not det.in_speech and det.now_ms == 0 and det.prefix_padding_ms == 300
    assert det.push(0.9) == TurnEvent("speech_started", 0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"threshold": 1.2}, "turn_detection.threshold=1.2 is outside 0.05..0.95"),
        ({"threshold": 0.04}, "turn_detection.threshold=0.04 is outside 0.05..0.95"),
        ({"threshold": float("nan")}, "turn_detection.threshold=nan is outside 0.05..0.95"),
        ({"prefix_padding_ms": -1}, "turn_detection.prefix_padding_ms=-1 is outside 0..2000"),
        ({"prefix_padding_ms": 2001}, "turn_detection.prefix_padding_ms=2001 is outside 0..2000"),
        ({"silence_duration_ms": 99}, "turn_detection.silence_duration_ms=99 is outside 100..5000"),
        ({"silence_duration_ms": 5001}, "turn_detection.silence_duration_ms=5001 is outside 100..5000"),
        ({"silence_duration_ms": 150.5}, "turn_detection.silence_duration_ms=150.5 is not a whole number"),
        ({"threshold": "0.5"}, "turn_detection.threshold='0.5' is not a number"),
        ({"eagerness": 1}, "turn_detection.eagerness is not a turn detection setting"),
    ],
)
def test_bounds_errors(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        check_turn_params(**params)  # type: ignore[arg-type]
    if "eagerness" in params:
        return
    with pytest.raises(ValueError, match=f"^{message}"):
        TurnDetector(**params)  # type: ignore[arg-type]
    det = TurnDetector()
    with pytest.raises(ValueError, match=f"^{message}"):
        det.update(**params)  # type: ignore[arg-type]
    assert (det.threshold, det.prefix_padding_ms, det.silence_duration_ms) == (0.5, 300, 500)


def test_bounds_edges_accepted() -> None:
    for name, (lo, hi) in BOUNDS.items():
        check_turn_params(**{name: lo})
        check_turn_params(**{name: hi})
    TurnDetector(threshold=0.95, prefix_padding_ms=2000, silence_duration_ms=5000)
    TurnDetector(threshold=0.05, prefix_padding_ms=0, silence_duration_ms=100)


@pytest.mark.parametrize(
    "text",
    ["Please call me back tomorrow afternoon at the office.", "The quick brown fox jumps over the lazy dog."],
)
def test_end_to_end_on_real_vad(speaker: Speaker, text: str) -> None:
    assert speaker.rate == 22050
    speech = speaker.float_audio(text)
    second = np.zeros(16000, np.float32)
    audio = np.concatenate([second, speech, second])
    audible = np.nonzero(np.abs(audio) > 0.005)[0]  # above -46 dBFS: the speech itself, soft tails included
    true_start_ms, true_end_ms = audible[0] / 16, (audible[-1] + 1) / 16

    engine = VadEngine()
    engine.load()
    try:
        stream = engine.open_stream()
        windows = [audio[i : i + WINDOW] for i in range(0, len(audio) - WINDOW + 1, WINDOW)]
        probs = engine.step([VadItem(stream, w) for w in windows])
    finally:
        engine.close()
    det = TurnDetector()
    events = _run(det, probs)
    assert [e.kind for _, e in events] == ["speech_started", "speech_stopped"], events
    (_, start), (stop_at, stop) = events
    assert abs(start.audio_ms - true_start_ms) <= 100, (start, true_start_ms)
    assert abs(stop.audio_ms - true_end_ms) <= 100, (stop, true_end_ms)  # Silero lags the end by 50-90 ms
    # The stop is reported once the silence has lasted silence_duration_ms (16 windows).
    assert (stop_at + 1) * WINDOW_MS - stop.audio_ms == 16 * WINDOW_MS
    assert det.turn_audio_bounds(start.audio_ms, stop.audio_ms) == (start.audio_ms - 300, stop.audio_ms)


def test_semantic_candidates_and_a_stop_by_the_session() -> None:
    """With candidate points a pause reports each as its silence reaches it (rounded up to whole
    windows), and `stop()` ends the turn where the silence began; speech that resumes starts the
    count again; the turn ends by itself at silence_duration_ms."""
    det = TurnDetector(silence_duration_ms=1000)
    det.candidates_ms = (200, 600)
    events = _run(det, [0.9] * 10 + [0.0] * 8 + [0.9] * 2 + [0.0] * 7)
    assert events == [(0, TurnEvent("speech_started", 0)), (16, TurnEvent("pause_candidate", 224)),
                      (26, TurnEvent("pause_candidate", 224))]
    assert det.silence_ms == 224 and det.voiced_end_ms == 640
    assert det.stop() == TurnEvent("speech_stopped", 640) and not det.in_speech and det.silence_ms == 0
    det.reset()
    events = _run(det, [0.9] * 3 + [0.0] * 32)
    assert [e.kind for _, e in events] == ["speech_started", "pause_candidate", "pause_candidate", "speech_stopped"]
    assert [e.audio_ms for _, e in events[1:]] == [224, 608, 96]
