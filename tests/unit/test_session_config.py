"""Session settings (docs/protocol.md#session-config): max_output_tokens 0 ("inf"), output_modality, and
turn_detection.idle_timeout_ms (server_vad only, OpenAI's bounds); the transport label of a call."""

from __future__ import annotations

import pytest
from rtmedia.server.services.realtime import transport_of
from rtmedia.server.session.config import (
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
    ((("rtmedia-transport", "twilio"),), "twilio"),
    ((("rtmedia-transport", "carrier-pigeon"),), "other"),
    ((("rtmedia-transport", ""),), "other"),
])
def test_transport_of_a_call(metadata, transport):
    assert transport_of(metadata) == transport


def tools(*functions: realtime_pb2.FunctionTool) -> realtime_pb2.Tools:
    return realtime_pb2.Tools(functions=list(functions))


def with_tools(settings: SessionSettings, **fields) -> SessionSettings:
    return settings.updated(realtime_pb2.SessionConfig(responder="openai", **fields), VOICES, ["echo", "openai"],
                            tool_responders=["openai"])


def test_tools_their_choice_and_the_wait_are_checked_and_echoed():
    f = realtime_pb2.FunctionTool(name="get_weather", description="d", parameters='{"type": "object"}')
    settings = with_tools(SessionSettings(), tools=tools(f), tool_timeout_ms=1000, tool_filler_ms=0,
                          tool_choice=realtime_pb2.ToolChoice(mode=realtime_pb2.TOOL_CHOICE_MODE_FUNCTION,
                                                              name="get_weather"))
    assert [t.name for t in settings.tools] == ["get_weather"] and settings.tools[0].parameters == {"type": "object"}
    assert (settings.tool_choice, settings.tool_function) == ("function", "get_weather")
    assert (settings.tool_timeout_ms, settings.tool_filler_ms) == (1000, 0)
    echoed = settings.to_proto()
    assert echoed.tools.functions[0].name == "get_weather" and echoed.tool_choice.name == "get_weather"
    with pytest.raises(ConfigError, match="not one of the session's tools"):
        with_tools(settings, tools=tools())  # the choice would name a function that is gone
    auto = realtime_pb2.ToolChoice(mode=realtime_pb2.TOOL_CHOICE_MODE_AUTO)
    assert with_tools(settings, tools=tools(), tool_choice=auto).tools == (), "setting tools replaces them all"
    assert with_tools(SessionSettings(), tools=tools(realtime_pb2.FunctionTool(name="f"))).tools[0].parameters == {
        "type": "object", "properties": {}}, "no parameters: none"


@pytest.mark.parametrize(("fields", "param", "part"), [
    ({"tools": tools(*[realtime_pb2.FunctionTool(name=f"f{n}") for n in range(129)])}, "tools", "limit is 128"),
    ({"tools": tools(realtime_pb2.FunctionTool(name="f", description="x" * 4097))}, "tools.functions[0].description",
     "4096"),
    ({"tools": tools(realtime_pb2.FunctionTool(name="f", parameters='{"a": "' + "x" * 17000 + '"}'))},
     "tools.functions[0].parameters", "bytes"),
    ({"tool_choice": realtime_pb2.ToolChoice(mode=realtime_pb2.TOOL_CHOICE_MODE_AUTO, name="f")}, "tool_choice.name",
     "mode function"),
    ({"tool_choice": realtime_pb2.ToolChoice(mode=realtime_pb2.TOOL_CHOICE_MODE_FUNCTION)}, "tool_choice.name",
     "mode function"),
    ({"tool_choice": realtime_pb2.ToolChoice(mode=9)}, "tool_choice.mode", "not a tool choice"),
    ({"tool_timeout_ms": 999}, "tool_timeout_ms", "1000..120000"),
    ({"tool_filler_ms": 99}, "tool_filler_ms", "or 0: off"),
    ({"tool_filler_ms": 10001}, "tool_filler_ms", "100..10000"),
])
def test_bad_tool_settings_name_the_field(fields, param, part):
    with pytest.raises(ConfigError, match=part) as err:
        with_tools(SessionSettings(), **fields)
    assert err.value.param == param


def test_tools_on_a_responder_that_cannot_call_them_name_it():
    f = realtime_pb2.FunctionTool(name="f")
    with pytest.raises(ConfigError, match="the echo responder cannot call functions") as err:
        SessionSettings().updated(realtime_pb2.SessionConfig(responder="echo", tools=tools(f)), VOICES, ["echo"])
    assert err.value.param == "tools" and "none on this server" in str(err.value)
    settings = with_tools(SessionSettings(), tools=tools(f))
    with pytest.raises(ConfigError, match="echo responder"):
        settings.updated(realtime_pb2.SessionConfig(responder="echo"), VOICES, ["echo", "openai"], tool_responders=["openai"])


SEMANTIC = realtime_pb2.TURN_DETECTION_TYPE_SEMANTIC_VAD


def test_semantic_vad_eagerness_and_waits_are_checked_and_echoed():
    settings = update(SessionSettings(), turn_detection=turn(type=SEMANTIC))
    assert settings.vad_turns and settings.eagerness == "auto" and settings.turn_wait_ms == 4000
    echoed = settings.to_proto().turn_detection
    assert echoed.eagerness == realtime_pb2.EAGERNESS_AUTO and echoed.candidate_ms == 200 and echoed.max_wait_ms == 4000
    for eagerness, wait in ((realtime_pb2.EAGERNESS_LOW, 8000), (realtime_pb2.EAGERNESS_HIGH, 2000)):
        assert update(settings, turn_detection=turn(eagerness=eagerness)).turn_wait_ms == wait
    explicit = update(settings, turn_detection=turn(candidate_ms=300, max_wait_ms=1500))
    assert (explicit.candidate_ms, explicit.turn_wait_ms) == (300, 1500)


@pytest.mark.parametrize(("fields", "param", "part"), [
    ({"eagerness": 9}, "turn_detection.eagerness", "eagerness=9 is not an eagerness"),
    ({"candidate_ms": -200}, "turn_detection.candidate_ms", "candidate_ms=-200 is outside 200..2000"),
    ({"candidate_ms": 100}, "turn_detection.candidate_ms", "outside 200..2000"),
    ({"max_wait_ms": -1}, "turn_detection.max_wait_ms", "max_wait_ms=-1 is outside 500..30000"),
    ({"max_wait_ms": 60000}, "turn_detection.max_wait_ms", "outside 500..30000"),
])
def test_bad_semantic_vad_settings_name_the_field(fields, param, part):
    with pytest.raises(ConfigError, match=part) as err:
        update(SessionSettings(), turn_detection=turn(type=SEMANTIC, **fields))
    assert err.value.param == param


def transcription(language: str) -> realtime_pb2.InputAudioTranscription:
    return realtime_pb2.InputAudioTranscription(language=language)


def test_the_transcription_language_is_one_the_recogniser_serves_and_is_echoed_as_its_code():
    settings = SessionSettings()
    assert settings.language == "" and settings.to_proto().input_audio_transcription.language == ""
    for asked in ("en-US", "en", "english", "EN_us"):
        assert update(settings, input_audio_transcription=transcription(asked)).language == "en"
    with pytest.raises(ConfigError, match=r"input_audio_transcription.language 'fr' is not served by this "
                                          r"recogniser; it serves en \(an English-only model\)") as error:
        update(settings, input_audio_transcription=transcription("fr"))
    assert (error.value.param, error.value.code) == ("input_audio_transcription.language", "unsupported_language")
    multilingual = settings.updated(realtime_pb2.SessionConfig(input_audio_transcription=transcription("fr-FR")),
                                    VOICES, RESPONDERS, languages=("en", "fr"))
    assert multilingual.language == "fr" and multilingual.to_proto().input_audio_transcription.language == "fr"
    # a later update that does not name the language keeps it; "" goes back to detecting it
    kept = multilingual.updated(realtime_pb2.SessionConfig(instructions="Hi."), VOICES, RESPONDERS,
                                languages=("en", "fr"))
    assert kept.language == "fr" and update(kept, input_audio_transcription=transcription("")).language == ""
    assert update(settings, output_modality="text").language == ""  # other refusals keep invalid_value
    with pytest.raises(ConfigError) as other:
        update(settings, output_modality="smell")
    assert other.value.code == "invalid_value"
