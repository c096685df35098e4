"""Recording parts without a server: the timeline (rtmedia.protocol.recording) lays runs, starts a
stretch where audio came late, cuts a reply where it stopped being heard; the Ogg Opus file is
stereo and decodes; the JSON Lines form of an event holds no audio; the policy grants or refuses
`recording`; the deploy file's record_* settings are checked; the Realtime API door takes a
`recording` boolean."""

from __future__ import annotations

import os
import stat

import av
import numpy as np
import pytest
from rtmedia.engines.audio.resample import make_resampler
from rtmedia.protocol.events import client_event
from rtmedia.protocol.recording import FILE_RATE, RATE, OggOpusFile, Timeline, open_private
from rtmedia.server.config import ServerConfig
from rtmedia.server.observe.recording import RecordingPolicy, event_json
from rtmedia.server.session.config import ConfigError, SessionSettings
from rtmedia.web.openai.realtime_config import RealtimeError, new_config


def ones(seconds: float, rate: int, level: float = 0.5) -> np.ndarray:
    return np.full(int(seconds * rate), level, np.float32)


def spans(channel: np.ndarray) -> tuple[int, int]:
    loud = np.flatnonzero(np.abs(channel) > 1000)
    return int(loud[0]), int(loud[-1]) + 1


def test_runs_lie_where_they_came_continuous_and_a_late_chunk_starts_a_stretch():
    t = Timeline(make_resampler)
    t.add(0, "user", ones(1.0, 16000), 16000, 0)
    t.add(1, "r", ones(0.2, 24000), 24000, RATE // 2)
    t.add(1, "r", ones(0.2, 24000), 24000, RATE // 2)  # came before its place: continuous
    t.add(1, "r", ones(0.1, 24000), 24000, 2 * RATE)  # came after its place: a gap
    t.finish_all()
    out = t.take(t.end)
    assert spans(out[:, 0]) == (0, RATE)
    right = np.abs(out[:, 1]) > 1000
    assert right[RATE // 2 + 10: RATE // 2 + int(0.4 * RATE) - 10].all()
    assert not right[RATE // 2 + int(0.4 * RATE) + 10: 2 * RATE - 10].any()
    assert right[2 * RATE + 10: 2 * RATE + int(0.1 * RATE) - 10].all()


def test_a_cut_removes_what_was_not_heard_and_what_comes_later():
    t = Timeline(make_resampler)
    t.add(1, "r", ones(1.0, 24000), 24000, 0)
    t.cut_from("r", RATE // 4)  # stopped hearing it 250 ms in
    t.add(1, "r", ones(0.5, 24000), 24000, 0)  # late audio of the cut reply
    t.add(1, "s", ones(0.2, 24000), 24000, RATE)
    t.finish_all()
    out = t.take(t.end)
    start, end = spans(out[: RATE - 100, 1])
    assert start == 0 and abs(end - RATE // 4) <= 1
    assert spans(out[RATE - 100:, 1])[0] <= 101  # another reply is not cut


def test_what_is_taken_no_longer_changes():
    t = Timeline(make_resampler)
    t.add(1, "r", ones(1.0, 48000), 48000, 0)
    first = t.take(RATE // 2)
    t.cut_from("r", 0)
    assert spans(first[:, 1]) == (0, RATE // 2)
    assert not np.abs(t.take(RATE)).any()


def test_the_ogg_opus_file_is_stereo_and_private(tmp_path):
    path = tmp_path / "a.ogg"
    audio = OggOpusFile(open_private(path))
    stereo = np.zeros((RATE, 2), np.int16)
    stereo[:, 0] = (np.sin(np.arange(RATE) * 2 * np.pi * 440 / RATE) * 8000).astype(np.int16)
    written = audio.write(stereo) + audio.close()
    assert written == path.stat().st_size == audio.bytes and stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        open_private(path)
    os.close(open_private(path, replace=True))
    assert path.stat().st_size == 0
    path.write_bytes(b"")


def test_the_ogg_opus_file_decodes_with_each_channel_apart(tmp_path):
    path = tmp_path / "a.ogg"
    audio = OggOpusFile(open_private(path))
    stereo = np.zeros((RATE * 2, 2), np.int16)
    stereo[:RATE, 0] = (np.sin(np.arange(RATE) * 2 * np.pi * 300 / RATE) * 8000).astype(np.int16)
    stereo[RATE:, 1] = stereo[:RATE, 0]
    for n in range(0, stereo.shape[0], 960 * 5):
        audio.write(stereo[n:n + 960 * 5])
    audio.close()
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        assert stream.channels == 2 and stream.rate == FILE_RATE
        decoded = np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
    left, right, second = decoded[0], decoded[1], FILE_RATE
    assert np.abs(left[second // 10: second - second // 10]).max() > 0.1
    assert np.abs(right[second // 10: second - second // 6]).max() < 0.01


def test_the_events_json_holds_sizes_not_audio():
    line = event_json(client_event("conversation.item.create", item={"role": "user", "audio": b"\1" * 300}))
    assert line["item"]["audio_bytes"] == 300 and "audio" not in line["item"]
    line = event_json(client_event("camera.frame", image=b"\0" * 10))
    assert line == {"type": "camera.frame", "image_bytes": 10}
    assert event_json(client_event("response.cancel")) == {"type": "response.cancel"}


def test_the_policy_grants_or_refuses_recording():
    asked = SessionSettings(recording=True)
    with pytest.raises(ConfigError) as refused:
        RecordingPolicy().checked(asked)
    assert refused.value.param == "recording" and "--record-dir" in str(refused.value)
    assert RecordingPolicy().checked(SessionSettings(recording=False)).recording is None
    assert RecordingPolicy("d", on_request=True).checked(asked).recording is True
    with pytest.raises(ConfigError):
        RecordingPolicy("d").checked(SessionSettings(recording=False))
    assert [RecordingPolicy(*a).setting() for a in ((), ("d",), ("d", True))] == [None, True, False]


@pytest.mark.parametrize(("settings", "problem"), [
    ({"record_on_request": True}, "needs record_dir"),
    ({"record_dir": "d", "record_max_mb": 0}, "record_max_mb"),
    ({"record_dir": "d", "record_max_s": -1}, "record_max_s"),
    ({"record_dir": "d", "record_retention_h": -1}, "record_retention_h"),
])
def test_bad_record_settings_are_refused(settings, problem):
    with pytest.raises(ValueError, match=problem):
        ServerConfig.of(**settings)


def test_the_realtime_api_door_takes_a_recording_boolean():
    config = new_config(session={"type": "realtime", "recording": True})
    assert config.to_rtmedia()["recording"] is True
    assert "recording" not in new_config().to_rtmedia()
    with pytest.raises(RealtimeError) as refused:
        new_config(session={"type": "realtime", "recording": "yes"})
    assert refused.value.param == "session.recording"
