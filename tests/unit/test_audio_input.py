"""AudioInput: a format change survives a later session.update; the VAD tick's actions do not
depend on chunking; semantic_vad's candidate points and the session's end of a turn."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from rtmedia.server.hearing.audio_input import AudioInput
from rtmedia.server.session.config import SessionSettings


class VadRow:
    """Stands in for the VAD engine's per-session row (only reset() is used here)."""

    def reset(self) -> None:
        pass


def test_pending_format_change_survives_another_update():
    """session.update (16 kHz) then session.update (turn settings) before any tick: the
    session decodes 16 kHz audio, not the default 24 kHz (the WebRTC bridge sends its
    format, then the page its turn mode, before the microphone's first audio)."""
    audio = AudioInput(SessionSettings(), 2000, lambda actions: None, VadRow())
    at_16k = dataclasses.replace(SessionSettings(), input_rate=16000)
    audio.reconfigure(at_16k, reset=False)
    audio.reconfigure(dataclasses.replace(at_16k, silence_duration_ms=700), reset=False)
    _, frontend = audio.take()
    assert frontend.settings.input_rate == 16000
    # The frontend resamples for the 16 kHz VAD: 16 kHz input passes through unchanged.
    assert len(frontend.resampler.process(np.zeros(1600, np.float32))) == 1600
    assert frontend.settings.silence_duration_ms == 700
    assert audio.bytes_per_ms == 32


def test_turn_settings_change_in_place():
    audio = AudioInput(SessionSettings(), 2000, lambda actions: None, VadRow())
    _, before = audio.take()
    audio.reconfigure(dataclasses.replace(SessionSettings(), silence_duration_ms=900), reset=False)
    _, after = audio.take()
    assert after is before and after.settings.silence_duration_ms == 900


def _tick_run(engine, pcm: bytes, chunk_bytes: int, transcription: bool = True) -> list:
    """All the actions the VAD tick delivers for `pcm` (16 kHz) sent in `chunk_bytes`
    pieces, one tick per piece; turn audio joined into one ("audio", (offset, pcm)) per turn,
    and each pause as ("pause", where the turn audio sent before it ends, in ms)."""
    from rtmedia.server.hearing.audio_input import VadTick

    got: list = []
    tick = VadTick(engine)
    settings = dataclasses.replace(SessionSettings(), input_rate=16000, transcription=transcription)
    inp = AudioInput(settings, 2000, got.extend, engine.open_stream())
    tick.inputs.add(inp)
    for at in range(0, len(pcm), chunk_bytes):
        inp.append(pcm[at:at + chunk_bytes])
        tick.deliver(tick.process(tick.collect()))
    joined: list = []
    turn_audio = None  # the index of the current turn's ("audio", ...) in joined
    for kind, value in got:
        if kind == "audio" and turn_audio is not None:
            offset, audio = joined[turn_audio][1]
            assert offset + len(audio) // 32 == value[0]  # turn audio is contiguous
            joined[turn_audio] = ("audio", (offset, audio + value[1]))
        elif kind == "pause":
            offset, audio = joined[turn_audio][1]
            joined.append(("pause", offset + len(audio) // 32))
        else:
            turn_audio = len(joined) if kind == "audio" else None
            joined.append((kind, value))
    return joined


def test_tick_results_do_not_depend_on_chunking(speaker):
    """The same speech sent as one window per tick and as 100 ms chunks (three or four
    windows per tick, a turn's audio in one piece per tick) gives the same events and
    the same turn audio, prefix padding included and trailing silence cut to 160 ms, a
    pause inside a turn kept, and the same pauses (160 ms after each run of speech, the
    turn audio sent up to there); without transcription, the same events and no audio."""
    from rtmedia.engines.vad.silero import VadEngine

    engine = VadEngine()
    engine.load()
    pieces = [speaker.silence(0.7), speaker.say("Please call me back tomorrow afternoon."),
              speaker.silence(0.2), speaker.say("Thanks."),
              speaker.silence(1.2), speaker.say("What time is it?"), speaker.silence(0.9)]
    pcm = np.concatenate(pieces).astype("<i2").tobytes()
    per_window = _tick_run(engine, pcm, 1024)
    kinds = [kind for kind, _ in per_window]
    assert kinds == ["started", "audio", "pause", "pause", "stopped", "started", "audio", "pause", "stopped"]
    started, (offset, audio) = per_window[0][1], per_window[1][1]
    assert offset == started - 300  # 300 ms of prefix padding before the speech
    # The first turn's audio is the input's, the ~350 ms quiet before "Thanks." included.
    assert pcm[offset * 32:offset * 32 + len(audio)] == audio
    # Its first pause came in that quiet, 160 ms after the first sentence's speech.
    first_end = (len(pieces[0]) + len(pieces[1])) // 16  # the first sentence's end (Piper's own quiet included)
    assert first_end - 300 < per_window[2][1] <= first_end + 160
    for audio_at, pause_at, stopped_at in ((1, 3, 4), (6, 7, 8)):  # each turn's audio ends 160 ms after its speech
        (_, (offset, audio)), (_, paused), (_, stopped) = (per_window[n] for n in (audio_at, pause_at, stopped_at))
        assert offset + len(audio) // 32 == paused == stopped.audio_end_ms + 160
        assert stopped.reason == "silence" and stopped.score is None and stopped.silence_ms == 512
    assert _tick_run(engine, pcm, 3200) == per_window
    events = [(kind, value) for kind, value in per_window if kind not in ("audio", "pause")]
    assert _tick_run(engine, pcm, 3200, transcription=False) == events


def test_audio_that_is_not_whole_samples_is_refused_at_the_inbox():
    """The shared VAD tick decodes every inbox: a caller's odd PCM16 byte count is refused where
    it is appended, so it cannot fail the tick for the other sessions."""
    audio = AudioInput(SessionSettings(), 2000, lambda actions: None, VadRow())
    with pytest.raises(ValueError, match="not whole samples"):
        audio.append(bytes(11025))
    assert not audio.inbox
    assert audio.append(bytes(11026)) is None and len(audio.inbox) == 11026


def test_the_inbox_bound_drops_old_audio_with_vad_and_refuses_new_audio_without():
    """With VAD an overflow discards the queued audio (and a chunk over the bound by itself);
    without VAD a chunk is taken whole while what is queued is within the bound, and refused
    whole once it is not, discarding nothing."""
    from rtmedia.server.hearing.audio_input import Overflow

    second = 48  # bytes per ms at 24 kHz PCM16
    vad = AudioInput(SessionSettings(), 2000, lambda actions: None, VadRow())
    assert vad.append(bytes(1500 * second)) is None
    assert vad.append(bytes(1000 * second)) == Overflow(1500, chunk_kept=True) and len(vad.inbox) == 1000 * second
    assert vad.append(bytes(3000 * second)) == Overflow(4000, chunk_kept=False) and not vad.inbox
    manual = AudioInput(dataclasses.replace(SessionSettings(), turn_type="manual"), 2000, lambda actions: None, None)
    assert manual.append(bytes(3000 * second)) is None and len(manual.inbox) == 3000 * second
    assert manual.append(bytes(20 * second)) == Overflow(0, chunk_kept=False) and len(manual.inbox) == 3000 * second
    manual.take()
    assert manual.append(bytes(1900 * second)) is None and manual.append(bytes(500 * second)) is None
    assert len(manual.inbox) == 2400 * second


def test_semantic_vad_candidates_and_the_sessions_end_of_a_turn(speaker):
    """semantic_vad: a pause reports its candidate points (the silence so far, where it began);
    end_turn ends the turn at the next tick, even one without new audio, where the pause began;
    a request for a pause that speech has ended since is dropped; left alone, a turn ends at
    the longest wait, reason max_wait."""
    from rtmedia.engines.vad.silero import VadEngine
    from rtmedia.server.hearing.audio_input import Stop, VadTick

    engine = VadEngine()
    engine.load()
    got: list = []
    tick = VadTick(engine)
    settings = dataclasses.replace(SessionSettings(), input_rate=16000, turn_type="semantic_vad", max_wait_ms=1000)
    inp = AudioInput(settings, 4000, got.extend, engine.open_stream())
    tick.inputs.add(inp)

    def run(pcm: np.ndarray) -> list:
        got.clear()
        data = pcm.astype("<i2").tobytes()
        for at in range(0, len(data), 1024):
            inp.append(data[at:at + 1024])
            tick.deliver(tick.process(tick.collect()))
        return [(kind, value) for kind, value in got if kind not in ("audio", "pause")]

    words = speaker.say("Please call me back tomorrow afternoon.")
    events = run(np.concatenate([speaker.silence(0.5), words, speaker.silence(0.3)]))
    assert [kind for kind, _ in events] == ["started", "candidate"]
    silence_ms, end_ms = events[1][1]
    assert silence_ms == 224  # 200 ms rounded up to whole windows
    inp.end_turn(Stop(end_ms + 32, "semantic", -1.0))  # not this pause: dropped
    tick.deliver(tick.process(tick.collect()))
    inp.end_turn(Stop(end_ms, "semantic", -1.0))
    got.clear()
    tick.deliver(tick.process(tick.collect()))  # no new audio: the request alone
    assert [kind for kind, _ in got] == ["stopped"]
    stop = got[0][1]
    assert stop.audio_end_ms == end_ms and stop.reason == "semantic" and stop.silence_ms >= 224
    events = run(np.concatenate([words, speaker.silence(1.2)]))
    assert [kind for kind, _ in events] == ["started", "candidate", "candidate", "candidate", "stopped"]
    assert [value[0] for kind, value in events if kind == "candidate"] == [224, 512, 608]  # 200, 500, 600 ms
    assert events[-1][1].reason == "max_wait" and events[-1][1].silence_ms == 1024
