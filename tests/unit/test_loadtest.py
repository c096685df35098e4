"""`rtmedia loadtest` logic without a server: percentiles, the SLO, the capacity
search, argument checks, clip loading and the chart."""

from __future__ import annotations

import re

import numpy as np
import pytest
from rtmedia.clients.audio_file import write_audio
from rtmedia.clients.commands.cli import CliError
from rtmedia.clients.loadtest.harness import check_args
from rtmedia.clients.loadtest.report import (
    LATENCIES,
    Stats,
    build_report,
    capacity,
    latency_summary,
    next_level,
    slo_verdict,
    summary_lines,
    write_plot,
)
from rtmedia.clients.loadtest.settings import session_config
from rtmedia.clients.loadtest.speech import audio_files, load_clips
from rtmedia.server.cli import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["loadtest", *argv])


def test_latency_summary_percentiles():
    s = latency_summary(float(v) for v in range(1, 101))
    assert s == {"p50": 50.5, "p95": 95.0, "p99": 99.0, "max": 100.0, "count": 100}
    assert latency_summary([]) == {"p50": None, "p95": None, "p99": None, "max": None, "count": 0}
    assert latency_summary([7.25]) == {"p50": 7.2, "p95": 7.2, "p99": 7.2, "max": 7.2, "count": 1}


def report_with(profile: str = "talk", **fields) -> dict:
    stats = Stats(origin=0.0)
    stats.started = stats.completed = 4
    for n in range(20):
        stats.record("response_latency_ms", 0.1 + n / 100, n)  # 100..290 ms
        stats.record("vad_start_ms", 0.05, n)
    report = build_report(stats, {"profile": profile, "sessions": 4, "chunk_ms": 20}, wall_s=10, cpu_s=2, cores=2,
                          per_session=[])
    report.update(fields)
    return report


def test_report_has_every_key():
    report = report_with()
    for key in ("sessions_started", "sessions_completed", "sessions_rejected", "errors", "errors_by_code",
                "underruns", "loadgen_cpu_share"):
        assert key in report
    for metric in LATENCIES:
        assert set(report[metric]) == {"p50", "p95", "p99", "max", "count"}
    assert report["loadgen_cpu_share"] == 0.1
    assert report["response_latency_ms"]["count"] == 20


def test_the_servers_stages_are_summarised_from_the_responses_timings():
    stats = Stats(origin=0.0)
    stats.record_timings({"turn_detection_ms": 520, "transcription_ms": 0, "first_text_ms": 0, "first_audio_ms": 0,
                          "voice_to_voice_ms": 540, "preemptive": "committed"})
    stats.record_timings({"turn_detection_ms": 510, "transcription_ms": 20, "first_text_ms": 5, "first_audio_ms": 90,
                          "voice_to_voice_ms": 640, "preemptive": "none"})
    stats.record_timings({"turn_detection_ms": 500, "preemptive": "none"})  # cancelled before its audio: not counted
    report = build_report(stats, {"profile": "talk", "sessions": 1, "chunk_ms": 20}, 10, 1, 2, [])
    assert report["server_stages_ms"]["voice_to_voice_ms"] == latency_summary([540, 640])
    assert report["server_stages_ms"]["first_audio_ms"]["p95"] == 85.5 and report["preemptive_committed"] == 1
    line = next(x for x in summary_lines(report) if x.startswith("server stages"))
    assert "voice_to_voice 590 / 635" in line and "1 of 2 prepared at a pause" in line, line


def test_slo_verdict():
    assert slo_verdict(report_with(), 500) == (True, "held")
    held, why = slo_verdict(report_with(), 200)
    assert not held and "response_latency_ms p95 280 > 200" in why
    assert not slo_verdict(report_with(underruns=1), 500)[0]
    held, why = slo_verdict(report_with(errors=2, errors_by_code={"input_backpressure": 2}), 500)
    assert not held and "input_backpressure: 2" in why
    assert not slo_verdict(report_with(sessions_rejected=1), 500)[0]
    assert not slo_verdict(report_with(sessions_completed=3), 500)[0]
    # listen has no responses: its SLO is on VAD start; transcribe measured nothing here
    assert slo_verdict(report_with("listen"), 100)[0]
    held, why = slo_verdict(report_with("transcribe"), 500)
    assert not held and "no transcript_final_ms measured" in why


@pytest.mark.parametrize("true_capacity", [0, 1, 7, 40, 333, 1999])
def test_capacity_search_finds_the_break(true_capacity):
    results: dict[int, bool] = {}
    tried = []
    while (level := next_level(results, 10, 1.5, 0.1, 2000)) is not None:
        assert level not in results
        tried.append(level)
        results[level] = level <= true_capacity
        assert len(tried) < 40
    found = capacity(results)
    assert found <= true_capacity
    if true_capacity >= 10:
        assert found >= true_capacity * 0.9 - 1
    assert (found == 2000) == (true_capacity >= 2000)


@pytest.mark.parametrize(("argv", "message"), [
    (["--sessions", "0"], "--sessions must be at least 1"),
    (["--ramp-per-s", "0"], "--ramp-per-s must be positive"),
    (["--duration", "-1"], "--duration must be positive"),
    (["--chunk-ms", "5"], "--chunk-ms must be 10..1000"),
    (["--input-rate", "44100"], "--input-rate must be one of 8000, 16000, 24000"),
    (["--barge-in-share", "1.5"], "--barge-in-share must be 0..1"),
    (["--turn-detection", "none", "--profile", "talk"], "only for --profile listen"),
    (["--sessions", "500", "--ramp-per-s", "10", "--duration", "30"], "takes 49.9 s"),
    (["--find-capacity", "--sessions", "50", "--capacity-limit", "20"], "below --sessions"),
    (["--eagerness", "high"], "--eagerness is for --turn-detection semantic_vad"),
    (["--paused-share", "2"], "--paused-share must be 0..1"),
    (["--paused-share", "0.5", "--audio", "."], "--paused-share speaks built-in sentences"),
    (["--profile", "barge-in", "--backchannel-share", "-0.1"], "--backchannel-share must be 0..1"),
    (["--profile", "barge-in", "--noise", "2"], "--noise must be 0..1"),
    (["--profile", "barge-in", "--backchannel-share", "0.7", "--noise", "0.5"], "add up to 1.2, more than 1"),
    (["--profile", "talk", "--noise", "0.5"], "are for --profile barge-in"),
    (["--profile", "listen", "--turn-detection", "none", "--interruption", "confirmed"], "needs turn detection"),
    (["--profile", "listen", "--turn-detection", "none", "--preemptive", "off"], "--preemptive needs turn detection"),
])
def test_impossible_parameters(argv, message):
    with pytest.raises(CliError, match=re.escape(message)):
        check_args(parse(*argv))


def test_session_configs():
    args = parse()
    assert session_config("listen", args) == {
        "input_audio_format": {"sample_rate": 16000}, "input_audio_transcription": {"enabled": False},
        "turn_detection": {"type": "server_vad", "create_response": False}}
    assert session_config("transcribe", args)["input_audio_transcription"] == {"enabled": True}
    assert session_config("talk", args)["responder"] == "echo"
    assert session_config("barge-in", args)["responder"] == "echo"
    assert session_config("llm", args)["responder"] == "llm"
    none = parse("--profile", "listen", "--turn-detection", "none")
    assert session_config("listen", none)["turn_detection"] == {"type": "none"}
    semantic = parse("--turn-detection", "semantic_vad", "--eagerness", "high")
    assert session_config("talk", semantic)["turn_detection"] == {"type": "semantic_vad", "eagerness": "high"}
    confirmed = parse("--interruption", "confirmed")
    assert session_config("talk", confirmed)["turn_detection"]["interruption"] == {"mode": "confirmed"}


def test_noise_bursts_are_short_loud_and_seeded():
    from rtmedia.clients.loadtest.speech import noise_clips

    clips = noise_clips(16000, 20, seed=3)
    again = noise_clips(16000, 20, seed=3)
    assert [c.chunks for c in clips] == [c.chunks for c in again]
    for clip in clips:
        assert clip.kind == "noise"
        assert 100 <= clip.voice_start_ms <= 105 and 60 < clip.voice_end_ms - clip.voice_start_ms <= 400
        pcm = np.frombuffer(b"".join(m.input_audio_buffer_append.audio for m in clip.chunks), np.int16)
        assert 0.25 * 32767 < np.abs(pcm.astype(np.int32)).max() <= 0.31 * 32767


def test_paused_clips_pause_600_to_900_ms_where_the_sentence_is_unfinished():
    from rtmedia.clients.loadtest.speech import PAUSED_SENTENCES, paused_clips

    clips = paused_clips(16000, 20, seed=3)
    assert len(clips) == len(PAUSED_SENTENCES) >= 20
    for clip in clips:
        start, end = clip.pause_ms
        assert 600 <= end - start <= 900 and clip.voice_start_ms < start < end < clip.voice_end_ms
        pcm = np.frombuffer(b"".join(c.input_audio_buffer_append.audio for c in clip.chunks), np.int16)
        assert not pcm[int(start * 16) + 1:int(end * 16) - 1].any()  # silence between the parts
    assert [c.pause_ms for c in paused_clips(16000, 20, seed=3)] == [c.pause_ms for c in clips]


def test_clips_from_a_directory(tmp_path):
    rate = 8000
    tone = (np.sin(np.arange(rate) * 2 * np.pi * 300 / rate) * 8000).astype(np.int16)
    write_audio(tmp_path / "a.wav", np.concatenate([np.zeros(rate // 4, np.int16), tone, np.zeros(77, np.int16)]).tobytes(),
              rate)
    (tmp_path / "notes.txt").write_text("not audio")
    paths = audio_files(tmp_path)
    assert [p.name for p in paths] == ["a.wav"]
    (clip,) = load_clips(paths, 16000, 20)  # resampled 8 -> 16 kHz, 20 ms = 320 samples per chunk
    assert all(len(c.input_audio_buffer_append.audio) == 640 for c in clip.chunks)
    assert len(clip.chunks) == -(-(rate + rate // 4 + 77) * 2 // 320)
    assert clip.voice_start_ms == pytest.approx(250, abs=3)
    assert clip.voice_end_ms == pytest.approx(1250, abs=3)


def test_bad_audio_dirs(tmp_path):
    with pytest.raises(CliError, match="not a directory"):
        audio_files(tmp_path / "missing")
    with pytest.raises(CliError, match=r"no audio files in it$"):
        audio_files(tmp_path)
    (tmp_path / "bad.wav").write_bytes(b"RIFF nonsense")
    with pytest.raises(CliError, match=r"no audio files in it; not audio: bad\.wav \("):
        audio_files(tmp_path)
    write_audio(tmp_path / "bad.wav", bytes(1600), 8000)
    with pytest.raises(CliError, match="no speech"):
        load_clips(audio_files(tmp_path), 16000, 20)


def test_plot_is_a_png(tmp_path):
    stats = Stats(origin=0.0)
    for t in range(12):
        stats.active = min(t, 5)
        stats.record("response_latency_ms", 0.2 + t / 100, t)
        stats.tick(float(t))
    report = build_report(stats, {"profile": "talk", "sessions": 5, "chunk_ms": 20}, 12, 1, 2, [])
    write_plot(report, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
