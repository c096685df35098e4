"""Small server parts: WAV framing, configuration, error details."""

from __future__ import annotations

import io
import wave

import grpc
import pytest
from rtmedia.protocol.errors import DOMAIN, rich_status
from rtmedia.protocol.wav import wav_header, wav_stream_header
from rtmedia.server.config import ServerConfig


def test_wav_header_is_read_by_the_wave_module():
    pcm = b"\x01\x00\xff\x7f" * 100
    with wave.open(io.BytesIO(wav_header(16000, 2, len(pcm)) + pcm)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth(), wav.getnframes()) == (16000, 2, 2, 100)


def test_streaming_header_has_unknown_sizes():
    header = wav_stream_header(22050, 1)
    assert len(header) == 44 and header[4:8] == b"\xff\xff\xff\xff" and header[40:44] == b"\xff\xff\xff\xff"


def test_config_layers(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("server:\n  port: 6000\n  grace_s: 5\n  asr_workers: 1\n")
    config = ServerConfig.load(path, port=7000, host=None)
    assert (config.network.port, config.network.grace_s, config.asr.workers, config.network.host) == (
        7000,
        5,
        1,
        "127.0.0.1",
    )


def test_config_rejects_unknown_keys(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown setting\\(s\\): prot"):
        ServerConfig.load(path)


def test_config_rejects_no_vad_runs():
    assert ServerConfig.load(vad_threads=3).vad.threads == 3
    with pytest.raises(ValueError, match="vad_threads must be at least 1, got 0"):
        ServerConfig.load(vad_threads=0)


def test_stream_window_is_fixed_unless_zero():
    """A fixed read-ahead window per stream (grpc's adaptive one let a client that sends faster
    than its handler takes park tens of MiB in the server), or grpc's own with 0."""
    from rtmedia.server.app import grpc_options

    options = dict(grpc_options(ServerConfig.load(stream_window_bytes=65536)))
    assert options["grpc.http2.bdp_probe"] == 0 and options["grpc.http2.lookahead_bytes"] == 65536
    assert "grpc.http2.bdp_probe" not in dict(grpc_options(ServerConfig.load(stream_window_bytes=0)))
    with pytest.raises(ValueError, match="stream_window_bytes must be at least 0, got -1"):
        ServerConfig.load(stream_window_bytes=-1)


def test_config_rejects_an_unknown_tts_precision():
    assert ServerConfig.load(tts_precision="fp32").tts.precision == "fp32"
    with pytest.raises(ValueError, match="tts_precision must be one of auto, fp32, bf16, got 'int8'"):
        ServerConfig.load(tts_precision="int8")


def test_shipped_deploy_file_loads():
    from pathlib import Path

    config = ServerConfig.load(Path(__file__).resolve().parents[2] / "deploy" / "rtmedia.yaml")
    assert config.network.port == 50051


def test_rich_status_carries_error_info():
    from google.rpc import error_details_pb2, status_pb2

    status = rich_status(grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_TEXT", "text is empty", field="text")
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT and status.details == "text is empty"
    (key, value), = status.trailing_metadata
    decoded = status_pb2.Status.FromString(value)
    info = error_details_pb2.ErrorInfo()
    decoded.details[0].Unpack(info)
    assert key == "grpc-status-details-bin"
    assert (info.reason, info.domain, dict(info.metadata)) == ("EMPTY_TEXT", DOMAIN, {"field": "text"})


def test_the_twilio_door_needs_the_web_port():
    from rtmedia.server.cli import ServeConfig

    assert ServeConfig.of(web=True, web_twilio=True, web_twilio_insecure=True).twilio.enabled
    for bad, part in (({"web_twilio": True}, "it needs web"),
                      ({"web": True, "web_twilio_insecure": True}, "need web_twilio"),
                      ({"web": True, "web_twilio": True, "auth_tokens": "tokens"}, "--server-token")):
        with pytest.raises(ValueError, match=part):
            ServeConfig.of(**bad)


def test_turn_detection_defaults_of_the_deploy_file_are_checked():
    config = ServerConfig.of(turn_detection="semantic_vad", turn_eagerness="high",
                          semantic_thresholds={"high": [-2.0, -3.0, -3.0]})
    assert config.turn.semantic_thresholds["high"] == [-2.0, -3.0, -3.0]
    for bad, part in (({"turn_detection": "smart"}, "turn_detection must be server_vad or semantic_vad"),
                      ({"turn_eagerness": "eager"}, "turn_eagerness must be"),
                      ({"semantic_thresholds": {"high": [-1, -2]}}, "semantic_thresholds: high="),
                      ({"semantic_thresholds": {"high": [-3, -2, -4]}}, "none above the one before"),
                      ({"semantic_thresholds": {"auto": [-1, -2, -3]}}, "semantic_thresholds: auto=")):
        with pytest.raises(ValueError, match=part):
            ServerConfig.of(**bad)
    from rtmedia.server.app import RtmediaServer

    with pytest.raises(ValueError, match="semantic_vad needs an LM"):
        RtmediaServer(ServerConfig.of(port=0, metrics_port=0, llm=False, default_responder="echo",
                                   turn_detection="semantic_vad"))
