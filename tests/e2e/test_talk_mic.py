"""`rtmedia talk --mic` on real PortAudio devices: a private PulseAudio server's clocked null sink
(recorded) and a pipe source fed at real-time pace, through ALSA's pulse plugin."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support.pulse import MIC_RATE, LiveTalk, available, running_pulse, voiced_spans
from tests.support.serve import FEW_SPEAKERS, RTMEDIA, free_port, running_server
from tests.support.speech import write_wav

pytestmark = pytest.mark.e2e
SENTENCE = "Please tell me a long story about the weather in the mountains and the rivers."
SHORT = "Please tell me about the weather today."
INTERRUPTION = "Stop, that is enough."
BACKCHANNEL = "Yeah, okay."
NO_TRACEBACK = "Traceback"


@pytest.fixture(scope="module")
def pulse(tmp_path_factory):
    missing = available()
    if missing:
        pytest.fail(f"talk --mic tests need {missing}: `make setup` installs them")
    with running_pulse(tmp_path_factory.mktemp("pulse")) as server:
        yield server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server("--metrics-port", str(free_port()), "--no-llm", "--responder", "echo", log=log,
                        asr_decoders=FEW_SPEAKERS) as (target, _):
        yield {"target": target, "log": log}


@pytest.fixture(scope="module")
def speech(speaker):
    return {text: speaker.say(text, MIC_RATE) for text in (SENTENCE, SHORT, INTERRUPTION, BACKCHANNEL)}


def played_samples(recording: np.ndarray, sent: np.ndarray, max_gap_s: float = 0.5) -> int:
    """How much of `sent` (a reply's audio) the speaker played: where in the recording it starts
    (by cross-correlation of its first 0.3 s), and how far the recording matches it from there. A
    stretch of silence the sound server put in (an underrun on a busy machine: the rest of the
    reply comes after it) is stepped over, up to `max_gap_s`; anything else ends the match."""
    window = int(0.01 * MIC_RATE)

    def offset(piece: np.ndarray, at: int, span: int) -> int:
        """Where in recording[at:at + span + len(piece)] the piece fits best (cross-correlation)."""
        around = recording[at:at + span + len(piece)].astype(np.float64)
        return int(np.argmax(np.correlate(around, piece.astype(np.float64), mode="valid")))

    def matches(at: int, n: int, windows: int = 1) -> bool:
        a = recording[at:at + windows * window].astype(np.int32)
        b = sent[n:n + windows * window].astype(np.int32)
        return len(a) == len(b) and not (np.abs(a - b).max() > 64 and np.abs(b).max() > 64)

    start = offset(sent[:int(0.3 * MIC_RATE)], 0, len(recording))
    n = 0
    while n + window <= len(sent) and start + n + window <= len(recording):
        if not matches(start + n, n):
            gap = offset(sent[n:n + 3 * window], start + n, int(max_gap_s * MIC_RATE))
            if not gap or np.abs(recording[start + n:start + n + gap]).max() > 64 or not matches(start + n + gap, n, 3):
                break
            start += gap
        n += window
    return n


@pytest.mark.serial
def test_mic_turn_reply_barge_in_and_ctrl_c(served, pulse, speech, tmp_path):
    out, record = tmp_path / "reply.wav", tmp_path / "talk.ogg"
    live = LiveTalk(served, pulse, "-o", str(out), "--record", str(record))
    live.wait(lambda: live.events("session.updated"), why="session.updated")
    pulse.voice.say(np.concatenate([np.zeros(MIC_RATE // 2, np.int16), speech[SENTENCE]]))
    live.wait(lambda: any(e["played_ms"] >= 1500 for e in live.events("playback.acknowledged")), why="reply playing")
    pulse.voice.say(speech[INTERRUPTION])
    live.wait(lambda: live.events("output_audio_buffer.cleared"), why="the barge-in")
    live.wait(lambda: len([e for e in live.events("response.done") if e["status"] == "completed"]) >= 1, why="answer")
    done = live.events("response.done")
    second = done[-1]["response_id"]
    live.wait(lambda: any(e["response_id"] == second and e["played_ms"] > 0 and
                          e["played_ms"] >= sum(d["audio_bytes"] for d in live.events("response.output_audio.delta")
                                                if d["response_id"] == second) * 1000 // 2 // MIC_RATE - 1
                          for e in live.events("playback.acknowledged")), why="the answer played out")
    events, summary, stderr = live.interrupt()

    assert NO_TRACEBACK not in stderr
    assert summary["closed_reason"] == "client" and events[-1]["type"] == "session.closed"
    assert summary["output_sample_rate"] == MIC_RATE and summary["input_sample_rate"] == MIC_RATE
    first = events[[e["type"] for e in events].index("response.created")]["response_id"]
    cancelled = next(e for e in events if e["type"] == "response.done" and e["response_id"] == first)
    assert cancelled["status"] == "cancelled" and cancelled["status_reason"] == "turn_detected"
    assert len(summary["barge_in_ms"]) == 1 and 0 < summary["barge_in_ms"][0] < 2000
    assert summary["voice_to_voice_ms"][0] is not None and 0 < summary["voice_to_voice_ms"][0] < 10000

    # What the speaker played of the interrupted reply is what the last ack said was heard.
    acks = [e["played_ms"] for e in events if e["type"] == "playback.acknowledged" and e["response_id"] == first]
    heard_ms = summary["heard_ms"][0]
    assert acks[-1] == heard_ms
    deltas = [d for d in events if d["type"] == "response.output_audio.delta"]
    first_bytes = sum(d["audio_bytes"] for d in deltas if d["response_id"] == first)
    assert heard_ms < first_bytes * 1000 // 2 // MIC_RATE, "the reply was cut short"
    import av

    with av.open(str(out)) as container:
        sent = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    recording = pulse.recording()
    played = played_samples(recording, sent[:first_bytes // 2])
    assert abs(played * 1000 / MIC_RATE - heard_ms) <= 40, (played, heard_ms)
    # ... and the answer to the interruption came out of the speaker too.
    assert len(voiced_spans(recording)) >= 2

    # --record: the microphone as sent on the left, the replies as played on the right, the
    # interrupted one cut where the speaker stopped it, then the answer after the user's words.
    with av.open(str(record)) as container:
        stereo = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
        rate = container.streams.audio[0].rate
    left, right = (np.clip(channel * 32767, -32768, 32767).astype(np.int16) for channel in stereo)
    said, replies = voiced_spans(left, rate), voiced_spans(right, rate)
    assert len(said) >= 2 and len(replies) >= 2, (said, replies)
    cut = replies[0][0] + heard_ms / 1000
    assert replies[0][1] <= cut + 0.15, (replies, heard_ms)
    assert replies[1][0] > said[1][0], "the answer follows the interruption"


def test_confirmed_mode_holds_the_speaker_over_a_backchannel_and_plays_on(served, pulse, speech):
    live = LiveTalk(served, pulse, "--interruption", "confirmed")
    live.wait(lambda: live.events("session.updated"), why="session.updated")
    pulse.voice.say(np.concatenate([np.zeros(MIC_RATE // 2, np.int16), speech[SENTENCE]]))
    live.wait(lambda: any(e["played_ms"] >= 1500 for e in live.events("playback.acknowledged")), why="reply playing")
    pulse.voice.say(speech[BACKCHANNEL])
    live.wait(lambda: live.events("input_audio_buffer.backchannel"), why="the backchannel")
    live.wait(lambda: live.events("response.done"), why="the reply's end")
    sent_ms = live.events("response.done")[0]["usage"]["output_audio_ms"]  # played out, not only sent:
    live.wait(lambda: any(e["played_ms"] >= sent_ms - 100 for e in live.events("playback.acknowledged")),
              why="the reply played out")
    events, _, stderr = live.interrupt()

    assert NO_TRACEBACK not in stderr
    kinds = [e["type"] for e in events]
    assert "output_audio_buffer.cleared" not in kinds
    assert [e["status"] for e in events if e["type"] == "response.done"] == ["completed"]
    # While the voice was judged the speaker held the reply: what it played grew by no more than
    # what the device already had (the server's 1 s lead stayed queued, not played).
    paused, judged = kinds.index("input_audio_buffer.speech_tentative"), kinds.index("input_audio_buffer.backchannel")
    acks = [(n, e["played_ms"]) for n, e in enumerate(events) if e["type"] == "playback.acknowledged"]
    before = max(ms for n, ms in acks if n < paused)
    during = [ms for n, ms in acks if paused < n < judged]
    assert max(during, default=before) - before < 400, (before, during)
    assert max(ms for _, ms in acks) > before + 1000  # ... and played on afterwards


def test_half_duplex_mutes_the_microphone_while_a_reply_plays(served, pulse, speech):
    live = LiveTalk(served, pulse, "--half-duplex")
    live.wait(lambda: live.events("session.updated"), why="session.updated")
    pulse.voice.say(speech[SHORT])
    live.wait(lambda: any(e["played_ms"] >= 400 for e in live.events("playback.acknowledged")), why="reply playing")
    pulse.voice.say(speech[INTERRUPTION])  # spoken over the reply: not heard
    live.wait(lambda: live.events("response.done"), why="the reply ended")
    time.sleep(2.0)
    events, summary, _ = live.interrupt()
    types = [e["type"] for e in events]
    assert "output_audio_buffer.cleared" not in types
    assert summary["response_status"][0] == "completed" and summary["duplex"] == "half"
    assert types.count("input_audio_buffer.speech_started") == 1


def test_push_to_talk_space_starts_and_sends_a_turn(served, pulse, speech):
    master, slave = pty.openpty()
    try:
        live = LiveTalk(served, pulse, "--push-to-talk", stdin=slave)
        live.wait(lambda: live.events("session.updated"), why="session.updated")
        assert live.events("session.updated")[-1]["session"]["turn_detection"]["type"] == "manual"
        pulse.voice.say(speech[INTERRUPTION])  # before space: not sent
        time.sleep(len(speech[INTERRUPTION]) / MIC_RATE + 0.5)
        os.write(master, b" ")
        time.sleep(0.3)
        pulse.voice.say(speech[SHORT])
        time.sleep(len(speech[SHORT]) / MIC_RATE + 0.4)
        os.write(master, b" ")
        live.wait(lambda: live.events("response.done"), why="the reply")
        _, summary, _ = live.interrupt()
    finally:
        os.close(master)
        os.close(slave)
    assert summary["mode"] == "push_to_talk" and summary["response_status"] == ["completed"]
    assert len(summary["transcripts"]) == 1 and "weather" in summary["transcripts"][0].lower()
    assert "stop" not in summary["transcripts"][0].lower()


def test_devices_lists_the_pulse_devices(pulse):
    result = subprocess.run([RTMEDIA, "devices", "--json"], env=pulse.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    devices = [json.loads(line) for line in result.stdout.splitlines()]
    names = {d["name"]: d for d in devices}
    assert "pulse" in names and names["pulse"]["input_channels"] and names["pulse"]["output_channels"]
    plain = subprocess.run([RTMEDIA, "devices"], env=pulse.env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "pulse" in plain.stdout


@pytest.mark.parametrize("args, env_change, message", [
    (["--input-device", "no-such-mic"], {}, "no audio input device: 'no-such-mic'"),
    (["--output-device", "no-such-speaker"], {}, "no audio output device: 'no-such-speaker'"),
    ([], {"PULSE_SERVER": "unix:/nonexistent/native"}, "no audio input device: the default"),
    (["--input-device", "pulse"], {"PULSE_SOURCE": "no-such-source"}, "cannot open the microphone 'pulse'"),
    (["in.wav"], {}, "--mic takes the voice from the microphone: drop IN"),
    (["--push-to-talk"], {}, "standard input is not one"),
    (["--mode", "manual"], {}, "with --mic, manual turns are --push-to-talk"),
])
def test_device_and_option_mistakes_are_one_line(served, pulse, args, env_change, message):
    result = subprocess.run([RTMEDIA, "talk", "--mic", *args, "--target", served["target"]],
                            env={**pulse.env, **env_change}, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and NO_TRACEBACK not in result.stderr, result.stderr


def test_talk_without_in_or_mic_and_mic_flags_on_a_file(tmp_path, speaker):
    wav = write_wav(tmp_path / "in.wav", 16000, speaker.silence(0.2))
    for args, message in ((["talk"], "give IN"), (["talk", str(wav), "--half-duplex"], "--half-duplex is for --mic")):
        result = subprocess.run([RTMEDIA, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and message in result.stderr and NO_TRACEBACK not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


BROKEN_ALSA = {  # ALSA_CONFIG_PATH's file: content (None: no file), and what the one line says of it
    "missing": (None, "PortAudio crashed (SIGABRT) while it listed the audio devices (ALSA: Cannot access file "
                      "{path}); ALSA_CONFIG_PATH={path} is not a readable file"),
    "empty": ("", "PortAudio crashed (SIGABRT) while it listed the audio devices; check ALSA_CONFIG_PATH={path}"),
    "unparsable": ("pcm.default {\n type\n", "PortAudio: Unanticipated host error (ALSA: _toplevel_:3:0:Unexpected "
                                             "char; {path} may be old or corrupted"),
}


def alsa_config(tmp_path, kind: str) -> str:
    content, _ = BROKEN_ALSA[kind]
    path = tmp_path / "nonexistent" / "asound.conf" if content is None else tmp_path / f"{kind}.conf"
    if content is not None:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize("kind", list(BROKEN_ALSA))
@pytest.mark.parametrize("args", [["devices"], ["talk", "--mic", "--target", "127.0.0.1:1"]], ids=["devices", "talk"])
def test_a_broken_audio_system_is_one_line_not_a_crash(tmp_path, kind, args):
    """PortAudio aborts the process (an assert in its ALSA device listing) when ALSA has no usable
    configuration: the command says so in one line and exits 1 like every client error."""
    path = alsa_config(tmp_path, kind)
    result = subprocess.run([RTMEDIA, *args], env={**os.environ, "ALSA_CONFIG_PATH": path}, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and NO_TRACEBACK not in result.stderr, result.stderr
    said = BROKEN_ALSA[kind][1].format(path=path)
    assert lines[0].startswith(f"rtmedia {args[0]}: the audio system failed to start: {said}"), lines[0]


def test_the_probe_starts_portaudio_where_the_audio_system_works():
    """The child that starts PortAudio first says "ok" on a working system (no devices needed): a
    probe that broke would let every crash through unseen."""
    from rtmedia.clients.commands import audio_devices

    probe = subprocess.run([sys.executable, "-I", "-S", "-c", audio_devices._PROBE], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and probe.stdout.splitlines()[-1] == "ok", (probe.stdout, probe.stderr[-2000:])


def test_portaudio_failing_past_the_probe_is_a_device_error(tmp_path):
    """Should PortAudio start in the probe and then fail here, the error is still one DeviceError line."""
    code = ("from rtmedia.clients.commands import audio_devices as ad\nad._probed = ''\n"
            "try:\n    ad.portaudio()\nexcept ad.DeviceError as exc:\n    print(exc)\n")
    path = alsa_config(tmp_path, "unparsable")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ALSA_CONFIG_PATH": path},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the audio system failed to start: Error initializing PortAudio"), result.stdout
