"""Session settings (docs/protocol.md#session-config): max_output_tokens 0 ("inf"), output_modality, and
turn_detection.idle_timeout_ms (server_vad only, OpenAI's bounds); the transport label of a call."""

from __future__ import annotations

import pytest
from rtmedia.server.realtime_service import transport_of
from rtmedia.server.session_config import (
    ConfigError,
    SessionSettings,
    check_max_output_tokens,
    check_output_modality,
    output_tokens,
)
from rtmedia.v1 import realtime_pb2

VOICES = {"en_US-joe-medium": [22050, 24000]}
RESPONDERS = ["echo", "llm"]
MANUAL, NONE = realtime_pb2.TURN_DETECTION_TYPE_MANUAL, realtime_pb2.TURN_DETECTION_TYPE_NONE


def update(settings: SessionSettings, **fields) -> SessionSettings:
    return settings.updated(realtime_pb2.SessionConfig(**fields), VOICES, RESPONDERS)


def turn(**fields) -> realtime_pb2.TurnDetection:
    return realtime_pb2.TurnDetection(**fields)


def test_max_output_tokens_zero_is_inf_up_to_the_ceiling_and_is_echoed():
    settings = update(SessionSettings(), max_output_tokens=0)
    assert settings.max_output_tokens == 0 and settings.to_proto().max_output_tokens == 0
    assert output_tokens(0) == 4096 and output_tokens(12) == 12
    check_max_output_tokens(4096)
    for bad in (-1, 4097):
        with pytest.raises(ConfigError, match=f"max_output_tokens={bad} is outside 1..4096") as err:
            update(SessionSettings(), max_output_tokens=bad)
        assert err.value.param == "max_output_tokens"


def test_output_modality_is_audio_or_text():
    assert SessionSettings().to_proto().output_modality == "audio"
    assert update(SessionSettings(), output_modality="text").output_modality == "text"
    with pytest.raises(ConfigError, match="output_modality 'video' must be") as err:
        update(SessionSettings(), output_modality="video")
    assert err.value.param == "output_modality"
    with pytest.raises(ConfigError) as err:
        check_output_modality("", "response.output_modality")
    assert err.value.param == "response.output_modality"


def test_idle_timeout_ms_bounds_and_off():
    on = update(SessionSettings(), turn_detection=turn(idle_timeout_ms=5000))
    assert on.idle_timeout_ms == 5000 and on.to_proto().turn_detection.idle_timeout_ms == 5000
    assert update(on, turn_detection=turn(threshold=0.6)).idle_timeout_ms == 5000, "unset fields stay"
    off = update(on, turn_detection=turn(idle_timeout_ms=0))
    assert off.idle_timeout_ms is None and not off.to_proto().turn_detection.HasField("idle_timeout_ms")
    assert update(SessionSettings(), turn_detection=turn(idle_timeout_ms=30000)).idle_timeout_ms == 30000
    for bad in (4999, 30001, -5):
        with pytest.raises(ConfigError, match=f"idle_timeout_ms={bad} is outside 5000..30000") as err:
            update(SessionSettings(), turn_detection=turn(idle_timeout_ms=bad))
        assert err.value.param == "turn_detection.idle_timeout_ms"


@pytest.mark.parametrize("kind", [MANUAL, NONE])
def test_idle_timeout_ms_is_for_server_vad_only(kind):
    with pytest.raises(ConfigError, match="for server_vad turn detection only") as err:
        update(SessionSettings(), turn_detection=turn(type=kind, idle_timeout_ms=6000))
    assert err.value.param == "turn_detection.idle_timeout_ms"
    manual = update(SessionSettings(), turn_detection=turn(type=kind))
    with pytest.raises(ConfigError, match="for server_vad turn detection only"):
        update(manual, turn_detection=turn(idle_timeout_ms=6000))
    on = update(SessionSettings(), turn_detection=turn(idle_timeout_ms=6000))
    assert update(on, turn_detection=turn(type=kind)).idle_timeout_ms is None, "leaving server_vad turns it off"


@pytest.mark.parametrize("metadata,transport", [
    ((), "grpc"),
    (None, "grpc"),
    ((("authorization", "Bearer x"), ("rtmedia-transport", "openai-ws")), "openai-ws"),
    ((("rtmedia-transport", "webrtc"),), "webrtc"),
    ((("rtmedia-transport", "openai-webrtc"),), "openai-webrtc"),
    ((("rtmedia-transport", "carrier-pigeon"),), "other"),
    ((("rtmedia-transport", ""),), "other"),
])
def test_transport_of_a_call(metadata, transport):
    assert transport_of(metadata) == transport
