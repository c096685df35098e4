"""`rtmedia talk` against the real `rtmedia serve` process: duplex sessions from a WAV file."""

from __future__ import annotations

import json
import re
import subprocess
import wave
from pathlib import Path

import pytest

from tests.support.serve import FEW_SPEAKERS, RTMEDIA, free_port, running_server
from tests.support.speech import wer, write_wav

pytestmark = pytest.mark.e2e
RATE = 16000
SENTENCE = "Please tell me about the weather today."
LONG = "Please tell me a long story about the weather in the mountains."
INTERRUPTION = "Stop, that is enough."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server("--metrics-port", str(free_port()), "--grace", "5", log=log,
                        asr_decoders=FEW_SPEAKERS) as (target, process):
        yield {"target": target, "process": process, "log": log}


@pytest.fixture(scope="module")
def sentence_wav(tmp_path_factory, speaker) -> Path:
    """0.5 s silence, a sentence, 1.5 s silence."""
    path = tmp_path_factory.mktemp("talk") / "in.wav"
    return write_wav(path, RATE, speaker.silence(0.5, RATE), speaker.say(SENTENCE, RATE), speaker.silence(1.5, RATE))


def talk(served, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([RTMEDIA, "talk", *args, "--target", served["target"]], capture_output=True, text=True,
                            timeout=120)
    if check and result.returncode != 0:
        log = served["log"].read_text()[-3000:]
        raise AssertionError(f"rtmedia talk failed ({result.returncode}): {result.stderr}\nserver log:\n{log}")
    return result


def json_lines(result: subprocess.CompletedProcess) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines and lines[-1]["type"] == "summary", result.stdout[-2000:]
    return lines[:-1], lines[-1]


def in_order(types: list[str], expected: list[str]) -> bool:
    """`expected` is a subsequence of `types`."""
    it = iter(types)
    return all(name in it for name in expected)


def check_session(events: list[dict], summary: dict, output: Path) -> None:
    """What every successful single-turn echo session shows."""
    types = [e["type"] for e in events]
    assert types[0] == "session.created" and types[-1] == "session.closed", types
    assert events[-1]["reason"] == "client"
    assert all("t_ms" in e for e in events)
    times = [e["t_ms"] for e in events]
    assert times == sorted(times), "t_ms is the client's receive clock"
    assert in_order(types, ["session.created", "session.updated", "input_audio_buffer.committed",
                            "response.created", "response.output_audio.delta", "response.output_text.done",
                            "response.done", "session.closed"]), types
    # The reply speaks the transcript, so the transcript comes before the reply's audio.
    assert types.index("conversation.item.input_audio_transcription.completed") \
        < types.index("response.output_audio.delta")
    updated = events[types.index("session.updated")]["session"]
    assert updated["input_audio_format"] == {"encoding": "pcm16", "sample_rate": RATE, "channels": 1}
    assert updated["responder"] == "echo"

    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert all("audio" not in d and d["audio_bytes"] > 0 and d["channels"] == 1 for d in deltas)
    rates = {d["sample_rate"] for d in deltas}
    assert rates == {summary["reply_sample_rate"]}
    done = [e for e in events if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["completed"]
    frames = sum(d["audio_bytes"] for d in deltas) // 2
    assert done[0]["usage"]["output_audio_ms"] == frames * 1000 // summary["reply_sample_rate"]
    acks = [e["played_ms"] for e in events if e["type"] == "playback.acknowledged"]
    assert acks == sorted(acks) and len(acks) >= 3, "playback.ack about every 200 ms of play time"
    assert acks[-1] == done[0]["usage"]["output_audio_ms"], "the reply was played to its end"

    assert summary["responses"] == 1 and summary["response_status"] == ["completed"]
    assert summary["errors"] == [] and summary["barge_in_ms"] == [] and summary["timed_out"] is False
    assert summary["closed_reason"] == "client"
    assert len(summary["transcripts"]) == 1 and wer(SENTENCE, summary["transcripts"][0]) < 0.5, summary
    assert summary["reply_text"].startswith("You said:"), summary["reply_text"]
    (latency,), (v2v,) = summary["response_latency_ms"], summary["voice_to_voice_ms"]
    assert 0 < latency < 5000 and latency < v2v < 10000, summary
    assert abs(summary["reply_audio_s"] - frames / summary["reply_sample_rate"]) < 0.002
    assert summary["output"] == str(output)
    with wave.open(str(output)) as wav:
        assert wav.getframerate() == summary["reply_sample_rate"] and wav.getnchannels() == 1
        assert wav.getnframes() == frames


def test_help_mentions_pacing_and_modes():
    out = subprocess.run([RTMEDIA, "talk", "--help"], capture_output=True, text=True, check=True).stdout
    for text in ("--realtime", "10x real time", "2 s", "server_vad", "manual", "audio_bytes", "-45 dBFS"):
        assert text in out, text
    assert "talk" in subprocess.run([RTMEDIA, "--help"], capture_output=True, text=True, check=True).stdout


def test_server_vad_session_in_real_time(served, sentence_wav, tmp_path):
    output = tmp_path / "reply.wav"
    events, summary = json_lines(talk(served, str(sentence_wav), "-o", str(output), "--json", "--responder", "echo",
                                      "--realtime"))
    check_session(events, summary, output)
    types = [e["type"] for e in events]
    assert in_order(types, ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                            "input_audio_buffer.committed", "response.created"]), types
    assert types.count("input_audio_buffer.speech_started") == 1
    assert summary["reply_sample_rate"] == 22050  # the voice's native rate
    stopped = events[types.index("input_audio_buffer.speech_stopped")]
    silence = events[types.index("session.updated")]["session"]["turn_detection"]["silence_duration_ms"]
    # Real-time pacing: the server cannot decide before the audio (and the silence window) was sent.
    assert stopped["t_ms"] >= stopped["audio_end_ms"] + silence - 60, (stopped, silence)
    # Voice-to-voice includes the silence window; response latency starts after it.
    (latency,), (v2v,) = summary["response_latency_ms"], summary["voice_to_voice_ms"]
    assert v2v - latency > silence * 0.6, summary


def test_manual_session_faster_than_real_time(served, sentence_wav, tmp_path):
    output = tmp_path / "reply16k.wav"
    events, summary = json_lines(talk(served, str(sentence_wav), "-o", str(output), "--json", "--responder", "echo",
                                      "--mode", "manual", "--output-rate", "16000"))
    check_session(events, summary, output)
    types = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in types and "input_audio_buffer.speech_stopped" not in types
    assert types.count("input_audio_buffer.committed") == 1
    assert summary["reply_sample_rate"] == 16000 and summary["mode"] == "manual"
    committed = events[types.index("input_audio_buffer.committed")]
    assert committed["audio_ms"] == pytest.approx(summary["input_s"] * 1000, abs=2)
    # Sent at most 10x real time, and faster than real time.
    assert summary["input_s"] * 100 - 60 <= committed["t_ms"] < summary["input_s"] * 1000 * 0.5, committed


def test_human_output_is_a_transcript_with_latencies(served, sentence_wav, tmp_path):
    output = tmp_path / "reply.wav"
    result = talk(served, str(sentence_wav), "-o", str(output), "--responder", "echo")
    lines = result.stdout.splitlines()
    you = [line for line in lines if re.match(r"^\[\s*\d+\.\d\d s\] you: \S", line)]
    said = [line for line in lines if re.match(
        r"^\[\s*\d+\.\d\d s\] rtmedia: You said: .+ \(response \d+ ms, voice-to-voice \d+ ms\)$", line)]
    assert len(you) == 1 and len(said) == 1, result.stdout
    assert lines.index(you[0]) < lines.index(said[0])
    (stages,) = [line for line in lines if " stages: " in line]  # the server's response.timings
    assert re.search(r"stages: turn detection \d+ ms, transcript \d+ ms, first text \d+ ms, first audio \d+ ms; "
                     r"voice-to-voice \d+ ms \(server", stages), stages
    assert re.search(rf"wrote {re.escape(str(output))}: \d+\.\d\d s at 22050 Hz", result.stderr), result.stderr
    assert "1 response; response latency" in result.stderr
    assert output.stat().st_size > 44


def test_barge_in_cancels_the_reply(served, speaker, tmp_path):
    path = write_wav(tmp_path / "barge.wav", RATE, speaker.silence(0.5, RATE), speaker.say(LONG, RATE),
                     speaker.silence(1.2, RATE), speaker.say(INTERRUPTION, RATE), speaker.silence(1.5, RATE))
    events, summary = json_lines(talk(served, str(path), "--json", "--responder", "echo", "--realtime"))
    types = [e["type"] for e in events]
    assert in_order(types, ["response.created", "input_audio_buffer.speech_started", "output_audio_buffer.cleared",
                            "response.done", "input_audio_buffer.speech_stopped", "response.created",
                            "response.done", "session.closed"]), types
    assert summary["response_status"] == ["cancelled", "completed"], summary
    assert len(summary["barge_in_ms"]) == 1 and 0 < summary["barge_in_ms"][0] < 1500, summary
    assert summary["reply_text"].startswith("You said:") and len(summary["transcripts"]) == 2


def test_errors_are_one_line_and_nonzero(served, sentence_wav, tmp_path):
    bad_voice = talk(served, str(sentence_wav), "--voice", "nobody", check=False)
    assert bad_voice.returncode != 0 and bad_voice.stderr.strip().count("\n") == 0, bad_voice.stderr
    assert "rejected the session config" in bad_voice.stderr and "nobody" in bad_voice.stderr
    missing = talk(served, str(tmp_path / "missing.wav"), check=False)
    assert missing.returncode != 0 and missing.stderr.strip().count("\n") == 0
    down = subprocess.run([RTMEDIA, "talk", str(sentence_wav), "--target", f"127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode != 0 and down.stderr.strip().count("\n") == 0, down.stderr
    assert down.stderr.startswith("rtmedia talk: UNAVAILABLE"), down.stderr


def test_semantic_vad_says_why_the_turn_ended(served, sentence_wav):
    result = talk(served, str(sentence_wav), "--responder", "echo", "--mode", "semantic_vad", "--eagerness", "high",
                  "--realtime")  # (faster than real time, the silence would reach the longest wait before a score)
    assert re.search(r"^\[\s*\d+\.\d\d s\] end of turn: semantic \(score -?\d+\.\d\d\)$", result.stdout, re.M), \
        result.stdout
    assert "1 response; response latency" in result.stderr
    wrong = talk(served, str(sentence_wav), "--eagerness", "high", check=False)
    assert wrong.returncode != 0 and wrong.stderr.strip().count("\n") == 0
    assert "--eagerness is for --mode semantic_vad" in wrong.stderr, wrong.stderr
