"""The real `rtmedia serve` process, driven by the CLI and by a Node @grpc/grpc-js client."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.request
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.support.serve import FEW_SPEAKERS, RTMEDIA, free_port, running_server
from tests.support.speech import wer

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TEXT = "The weather today is sunny with a light breeze from the west. Please remember to buy milk and bread on your way home."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    metrics_port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server("--metrics-port", str(metrics_port), "--grace", "5", "--no-llm", "--responder", "echo",
                        log=log, asr_decoders=FEW_SPEAKERS) as (target, process):
        yield {"target": target, "metrics_port": metrics_port, "process": process, "log": log}


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([RTMEDIA, *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"rtmedia {args[0]} failed ({result.returncode}): {result.stderr}")
    return result


def test_help_explains_every_command():
    out = cli("--help").stdout
    for command in ("serve", "voices", "synth", "transcribe"):
        assert command in out
    options = {"serve": "--metrics-port", "synth": "--sample-rate", "transcribe": "--realtime", "voices": "--target"}
    for command, option in options.items():
        assert option in cli(command, "--help").stdout


def test_synth_then_transcribe_with_the_cli(served, tmp_path):
    wav_path = tmp_path / "speech.wav"
    synth = json.loads(cli("synth", TEXT, "-o", str(wav_path), "--sample-rate", "16000", "--json",
                           "--target", served["target"]).stdout)
    assert synth["sample_rate"] == 16000 and synth["channels"] == 1 and synth["chunks"] >= 2
    assert 0 < synth["first_audio_ms"] < 5000
    with wave.open(str(wav_path)) as wav:
        assert wav.getframerate() == 16000
        assert abs(wav.getnframes() / 16000 - synth["seconds"]) < 0.01

    lines = [json.loads(line) for line in cli("transcribe", str(wav_path), "--json",
                                               "--target", served["target"]).stdout.splitlines()]
    assert lines[-1]["type"] == "done"
    assert {line["type"] for line in lines[:-1]} <= {"partial", "final"}
    assert any(line["type"] == "final" for line in lines)
    assert all({"text", "start_ms", "end_ms"} <= set(line) for line in lines[:-1])
    assert wer(TEXT, lines[-1]["text"]) < 0.35, lines[-1]["text"]


def test_human_output_and_pcm_format(served, tmp_path):
    out = tmp_path / "speech.pcm"
    result = cli("synth", "Plain output for people.", "-o", str(out), "--format", "pcm", "--target", served["target"])
    assert "first audio after" in result.stderr and "wrote" in result.stderr
    assert out.stat().st_size % 2 == 0 and out.stat().st_size > 22050
    voices = cli("voices", "--target", served["target"]).stdout
    assert "en_US-joe-medium" in voices and "48000" in voices


def test_cli_errors_are_one_line_and_nonzero(served, tmp_path):
    result = cli("synth", "hi", "-o", str(tmp_path / "x.wav"), "--sample-rate", "7", "--target", served["target"],
                 check=False)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0
    assert "INVALID_ARGUMENT" in result.stderr and "sample_rate=7 is not supported" in result.stderr
    missing = cli("transcribe", str(tmp_path / "missing.wav"), "--target", served["target"], check=False)
    assert missing.returncode != 0 and missing.stderr.strip().count("\n") == 0
    down = cli("voices", "--target", f"127.0.0.1:{free_port()}", "--timeout", "2", check=False)
    assert down.returncode != 0 and ("UNAVAILABLE" in down.stderr or "DEADLINE_EXCEEDED" in down.stderr)


def test_metrics_endpoint(served):
    cli("voices", "--target", served["target"])
    body = urllib.request.urlopen(f"http://127.0.0.1:{served['metrics_port']}/metrics", timeout=5).read().decode()
    assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="ListVoices"' in body
    assert "rtmedia_lane_step_seconds_bucket" in body


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_grpc_js_client(served, tmp_path, speaker):
    if not (ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("node_modules is missing: run `make setup` (npm ci)")
    rate = 24000
    pcm = np.concatenate([speaker.silence(0.5, rate), speaker.say(TEXT, rate), speaker.silence(1.0, rate)])
    pcm_path = tmp_path / "input.pcm"
    pcm_path.write_bytes(pcm.tobytes())
    result = subprocess.run(["node", str(ROOT / "tests/e2e/interop/speech_client.js"), served["target"],
                             str(pcm_path), str(rate)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["voices"] == ["en_US-joe-medium"]
    assert report["synth"]["chunks"] >= 2 and report["synth"]["final"] is True
    assert report["synth"]["sample_rate"] == 16000 and report["synth"]["bytes"] > 16000
    finals = [t["text"] for t in report["transcripts"] if t["is_final"]]
    assert wer(TEXT, " ".join(finals)) < 0.35, finals
    assert report["error"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "supported rates: 8000, 16000, 22050, 24000, 44100, 48000" in report["error"]["details"]


def test_sigterm_drains_and_exits(served):
    process = served["process"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    log = served["log"].read_text()
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    messages = [r["msg"] for r in records]
    assert "serving" in messages and "signal received: draining" in messages and "stopped" in messages
