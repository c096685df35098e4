"""AudioInput.reconfigure: a format change survives a later session.update."""

from __future__ import annotations

import dataclasses

import numpy as np
from rtmedia.server.audio_input import AudioInput
from rtmedia.server.session_config import SessionSettings


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
