"""Canonical JSON events (docs/protocol.md#events) <-> ConverseRequest / ConverseResponse."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from rtmedia.protocol import events
from rtmedia.protocol.events import (
    CLIENT_EVENTS,
    SERVER_EVENTS,
    EventError,
    client_event,
    dumps,
    event_type,
    from_json,
    server_event,
    to_json,
)
from rtmedia.v1 import common_pb2, realtime_pb2
from rtmedia.v1.realtime_pb2 import ConverseRequest, ConverseResponse

F = FieldDescriptor


def _oneof_members(envelope: type[Message]) -> list[str]:
    return [field.name for field in envelope.DESCRIPTOR.oneofs_by_name["event"].fields]


def _populate(msg: Message) -> Message:
    """Set every field of `msg` (recursively) to a non-default value."""
    for fd in msg.DESCRIPTOR.fields:
        if fd.type == F.TYPE_MESSAGE:
            if fd.is_repeated:
                _populate(getattr(msg, fd.name).add())
                _populate(getattr(msg, fd.name).add())
            else:
                _populate(getattr(msg, fd.name))
            continue
        if fd.type == F.TYPE_ENUM:
            value = fd.enum_type.values[-1].number
        else:
            value = {
                F.TYPE_BYTES: b"\x00\xff\x10rtmedia",
                F.TYPE_STRING: f"{fd.name}-é",
                F.TYPE_BOOL: True,
                F.TYPE_FLOAT: 0.3,
                F.TYPE_DOUBLE: 0.1,
                F.TYPE_INT64: 2**40 + 7,
            }.get(fd.type, 1234)
        if fd.is_repeated:
            getattr(msg, fd.name).extend([value, value])
        else:
            setattr(msg, fd.name, value)
    return msg


def _every_event(envelope: type[Message], populated: bool) -> list[Message]:
    out = []
    for member in _oneof_members(envelope):
        msg = envelope()
        event = getattr(msg, member)
        event.SetInParent()
        if populated:
            _populate(event)
        if "event_id" not in event.DESCRIPTOR.fields_by_name:  # `error` has its own event_id
            msg.event_id = "evt_1"
        out.append(msg)
    return out


# ---- the name table ----

@pytest.mark.parametrize(("envelope", "table"), [(ConverseRequest, CLIENT_EVENTS),
                                                 (ConverseResponse, SERVER_EVENTS)])
def test_table_covers_every_oneof_member_exactly(envelope, table):
    members = _oneof_members(envelope)
    assert sorted(table.values()) == sorted(members)
    assert len(set(table.values())) == len(table)
    for name, member in table.items():
        assert name.replace(".", "_") == member
        assert event_type(envelope(**{member: {}})) == name


def test_client_and_server_names_are_disjoint():
    assert not set(CLIENT_EVENTS) & set(SERVER_EVENTS)


def test_table_spot_checks_from_spec():
    assert SERVER_EVENTS["input_audio_buffer.speech_started"] == "input_audio_buffer_speech_started"
    assert (SERVER_EVENTS["conversation.item.input_audio_transcription.delta"]
            == "conversation_item_input_audio_transcription_delta")
    assert SERVER_EVENTS["response.output_audio.delta"] == "response_output_audio_delta"
    assert SERVER_EVENTS["output_audio_buffer.cleared"] == "output_audio_buffer_cleared"
    assert CLIENT_EVENTS["session.update"] == "session_update"
    assert CLIENT_EVENTS["playback.ack"] == "playback_ack"


def test_event_type_of_an_empty_message():
    assert event_type(ConverseRequest()) == ""
    with pytest.raises(EventError) as info:
        to_json(ConverseResponse(event_id="x"))
    assert info.value.code == "invalid_event"


# ---- round trips ----

@pytest.mark.parametrize("populated", [True, False], ids=["populated", "empty"])
@pytest.mark.parametrize(("envelope", "kind"), [(ConverseRequest, "client"), (ConverseResponse, "server")])
def test_round_trip_every_event(envelope, kind, populated):
    for msg in _every_event(envelope, populated):
        obj = to_json(msg)
        assert obj["type"] == event_type(msg)
        assert from_json(obj, kind) == msg, obj
        line = dumps(msg)
        assert "\n" not in line and ", " not in line
        assert from_json(line, kind) == msg
        assert from_json(line.encode(), kind) == msg


def test_round_trip_populated_json_is_stable():
    for msg in _every_event(ConverseResponse, True) + _every_event(ConverseRequest, True):
        obj = json.loads(dumps(msg))
        assert to_json(from_json(obj, "server" if isinstance(msg, ConverseResponse) else "client")) == obj


# ---- exact JSON (docs/protocol.md#events) ----

def test_speech_started_exact():
    msg = server_event("input_audio_buffer.speech_started", item_id="item_1", audio_start_ms=1234)
    assert to_json(msg) == {"type": "input_audio_buffer.speech_started", "item_id": "item_1",
                            "audio_start_ms": 1234}


def test_output_audio_delta_exact():
    msg = server_event("response.output_audio.delta", event_id="evt_9", response_id="resp_1", item_id="item_2",
                       audio=b"\x01\x00\xff\x7f", sample_rate=24000, channels=1)
    assert to_json(msg) == {"type": "response.output_audio.delta", "event_id": "evt_9", "response_id": "resp_1",
                            "item_id": "item_2", "audio": "AQD/fw==", "sample_rate": 24000, "channels": 1}
    assert from_json(to_json(msg), "server").response_output_audio_delta.audio == b"\x01\x00\xff\x7f"


def test_response_done_cancelled_exact():
    msg = server_event("response.done", response_id="resp_1", status="cancelled", status_reason="barge_in",
                       usage={"input_tokens": 12, "output_tokens": 7, "output_audio_ms": 2**40})
    assert msg.response_done.status == realtime_pb2.RESPONSE_STATUS_CANCELLED
    assert to_json(msg) == {"type": "response.done", "response_id": "resp_1", "status": "cancelled",
                            "status_reason": "barge_in",
                            "usage": {"input_tokens": 12, "output_tokens": 7, "output_audio_ms": 2**40},
                            "function_calls": []}


def test_response_done_incomplete_exact():
    msg = server_event("response.done", response_id="resp_1", status="incomplete", status_reason="max_output_tokens",
                       usage={"output_tokens": 3, "output_audio_ms": 900})
    assert msg.response_done.status == realtime_pb2.RESPONSE_STATUS_INCOMPLETE
    assert to_json(msg) == {"type": "response.done", "response_id": "resp_1", "status": "incomplete",
                            "status_reason": "max_output_tokens",
                            "usage": {"input_tokens": 0, "output_tokens": 3, "output_audio_ms": 900},
                            "function_calls": []}


def test_item_events_exact():
    """The conversation item events (docs/protocol.md#conversation-items), both ways."""
    assert CLIENT_EVENTS["conversation.item.delete"] == "conversation_item_delete"
    assert CLIENT_EVENTS["conversation.item.retrieve"] == "conversation_item_retrieve"
    assert to_json(client_event("conversation.item.delete", item_id="item_1")) == {
        "type": "conversation.item.delete", "item_id": "item_1"}
    assert from_json({"type": "conversation.item.retrieve", "item_id": "x"}).conversation_item_retrieve.item_id == "x"
    created = from_json({"type": "conversation.item.create", "item": {"id": "clip", "audio": "AQI="}})
    assert created.conversation_item_create.item.audio == b"\x01\x02"
    item = {"id": "item_2", "role": "user", "text": "hello"}
    assert to_json(server_event("conversation.item.added", previous_item_id="item_1", item=item)) == {
        "type": "conversation.item.added", "previous_item_id": "item_1", "item": {**item, "audio": ""}}
    assert to_json(server_event("conversation.item.retrieved", item=item)) == {
        "type": "conversation.item.retrieved", "item": {**item, "audio": ""}}
    assert to_json(server_event("conversation.item.deleted", item_id="item_2")) == {
        "type": "conversation.item.deleted", "item_id": "item_2"}
    assert to_json(server_event("conversation.item.truncated", item_id="item_3", audio_end_ms=1500)) == {
        "type": "conversation.item.truncated", "item_id": "item_3", "content_index": 0, "audio_end_ms": 1500}
    assert to_json(server_event("conversation.item.input_audio_transcription.failed", item_id="item_4",
                                code="engine_failed", message="the asr lane's step failed")) == {
        "type": "conversation.item.input_audio_transcription.failed", "item_id": "item_4", "code": "engine_failed",
        "message": "the asr lane's step failed"}


def test_function_call_events_exact():
    """A function call, its output and the events around it (docs/protocol.md#tools)."""
    call = {"id": "item_3", "type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    assert to_json(server_event("response.output_item.added", response_id="resp_1", output_index=1,
                                item={**call, "arguments": ""})) == {
        "type": "response.output_item.added", "response_id": "resp_1", "output_index": 1,
        "item": {**call, "arguments": "", "role": "", "text": "", "audio": ""}}
    assert to_json(server_event("response.function_call_arguments.delta", response_id="resp_1", item_id="item_3",
                                output_index=1, call_id="call_1", delta='{"ci')) == {
        "type": "response.function_call_arguments.delta", "response_id": "resp_1", "item_id": "item_3",
        "output_index": 1, "call_id": "call_1", "delta": '{"ci'}
    done = server_event("response.done", response_id="resp_1", status="completed", function_calls=[call])
    assert to_json(done)["function_calls"] == [{**call, "role": "", "text": "", "audio": ""}]
    output = {"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "call_1",
                                                           "output": '{"temperature_c": 21}'}}
    assert to_json(from_json(output)) == output
    tools = {"type": "session.update", "session": {
        "tools": {"functions": [{"name": "get_weather", "description": "The weather.", "parameters": "{}"}]},
        "tool_choice": {"mode": "function", "name": "get_weather"}, "tool_timeout_ms": 5000, "tool_filler_ms": 0}}
    assert to_json(from_json(tools)) == tools
    assert to_json(server_event("response.created", response_id="resp_2", item_id="item_4", filler=True)) == {
        "type": "response.created", "response_id": "resp_2", "item_id": "item_4", "request_event_id": "",
        "filler": True}


def test_timeout_triggered_and_the_new_options_exact():
    assert to_json(server_event("input_audio_buffer.timeout_triggered", item_id="item_5", audio_start_ms=1000,
                                audio_end_ms=6000)) == {
        "type": "input_audio_buffer.timeout_triggered", "item_id": "item_5", "audio_start_ms": 1000,
        "audio_end_ms": 6000}
    create = {"type": "response.create", "max_output_tokens": 0, "output_modality": "text", "conversation": "none"}
    msg = from_json(create)
    assert msg.response_create.HasField("max_output_tokens") and msg.response_create.max_output_tokens == 0
    assert to_json(msg) == create, "an optional 0 is set, so it is shown"
    update = {"type": "session.update", "session": {"output_modality": "text", "max_output_tokens": 0,
                                                     "turn_detection": {"idle_timeout_ms": 6000}}}
    assert to_json(from_json(update)) == update


def test_server_events_show_plain_defaults():
    assert to_json(server_event("playback.acknowledged", response_id="r")) == {
        "type": "playback.acknowledged", "response_id": "r", "played_ms": 0}
    assert to_json(server_event("input_audio_buffer.committed")) == {
        "type": "input_audio_buffer.committed", "item_id": "", "previous_item_id": "", "audio_ms": 0}


def test_client_events_omit_plain_defaults():
    assert to_json(client_event("conversation.item.truncate", item_id="item_3")) == {
        "type": "conversation.item.truncate", "item_id": "item_3"}
    assert to_json(client_event("input_audio_buffer.commit")) == {"type": "input_audio_buffer.commit"}


SESSION_UPDATE = {
    "type": "session.update",
    "event_id": "evt_1",
    "session": {
        "input_audio_format": {"encoding": "g711_ulaw", "sample_rate": 8000, "channels": 1},
        "input_audio_transcription": {"enabled": False},
        "turn_detection": {"type": "server_vad", "threshold": 0.3, "silence_duration_ms": 700,
                           "create_response": False},
        "instructions": "Be brief.",
        "voice": "en_US-joe-medium",
        "max_session_s": 600,
    },
}


def test_session_update_exact():
    msg = from_json(SESSION_UPDATE)
    session = msg.session_update.session
    assert msg.event_id == "evt_1"
    assert session.input_audio_format.encoding == common_pb2.AUDIO_ENCODING_G711_ULAW
    assert session.turn_detection.type == realtime_pb2.TURN_DETECTION_TYPE_SERVER_VAD
    assert session.turn_detection.HasField("create_response") and not session.turn_detection.create_response
    assert not session.turn_detection.HasField("prefix_padding_ms")
    assert not session.HasField("responder") and not session.HasField("output_sample_rate")
    assert to_json(msg) == SESSION_UPDATE
    assert '"threshold":0.3,' in dumps(msg)


def test_session_updated_exact_with_defaults_and_unset_optionals():
    msg = server_event("session.updated", session={
        "input_audio_format": {"encoding": "pcm16", "sample_rate": 24000, "channels": 1},
        "turn_detection": {"type": "manual"},
        "output_sample_rate": 0,
    })
    assert to_json(msg) == {"type": "session.updated", "session": {
        "input_audio_format": {"encoding": "pcm16", "sample_rate": 24000, "channels": 1},
        "turn_detection": {"type": "manual"},
        "output_sample_rate": 0,
    }}


def test_error_event_carries_the_referenced_event_id():
    msg = server_event("error", code="invalid_value", message="bad", event_id="evt_7", param="session.voice")
    assert msg.event_id == "" and msg.error.event_id == "evt_7"
    assert to_json(msg) == {"type": "error", "code": "invalid_value", "message": "bad", "event_id": "evt_7",
                            "param": "session.voice"}
    assert from_json(to_json(msg), "server") == msg


def test_transcription_words_and_float32():
    msg = server_event("conversation.item.input_audio_transcription.completed", item_id="item_1",
                       transcript="hello", words=[{"word": "hello", "start_ms": 10, "end_ms": 400,
                                                   "confidence": 0.3}])
    assert to_json(msg)["words"] == [{"word": "hello", "start_ms": 10, "end_ms": 400, "confidence": 0.3}]
    assert msg.conversation_item_input_audio_transcription_completed.words[0].confidence != 0.3  # float32


@pytest.mark.parametrize("value", [0.5, 0.3, 0.05, 0.95, 1e-7, 123456.7, 3.4e38, 0.0])
def test_float32_shortest_repr(value):
    stored = realtime_pb2.TurnDetection(threshold=value).threshold
    assert events._float32(stored) == float(f"{value:.7g}")


def test_enum_short_names_derive_from_the_enum_name():
    names = {enum.DESCRIPTOR.name: sorted(events._enum_names(enum.DESCRIPTOR)[0])
             for enum in (common_pb2.AudioEncoding, realtime_pb2.TurnDetectionType, realtime_pb2.ResponseStatus)}
    assert names == {
        "AudioEncoding": ["g711_alaw", "g711_ulaw", "pcm16", "unspecified"],
        "TurnDetectionType": ["manual", "none", "semantic_vad", "server_vad", "unspecified"],
        "ResponseStatus": ["cancelled", "completed", "failed", "incomplete", "unspecified"],
    }


def test_int64_are_numbers_unlike_json_format():
    msg = server_event("input_audio_buffer.speech_stopped", item_id="i", audio_end_ms=2**40)
    assert json_format.MessageToDict(msg.input_audio_buffer_speech_stopped)["audioEndMs"] == str(2**40)
    assert f'"audio_end_ms":{2**40}' in dumps(msg)
    assert to_json(client_event("playback.ack", response_id="r", played_ms=1500))["played_ms"] == 1500
    assert from_json({"type": "playback.ack", "played_ms": 1.5e3}).playback_ack.played_ms == 1500


def test_constructors_take_python_values():
    fmt = common_pb2.AudioFormat(encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=16000, channels=1)
    msg = client_event("session.update", session={"input_audio_format": fmt,
                                                  "turn_detection": {"type": realtime_pb2.TURN_DETECTION_TYPE_NONE}})
    assert msg.session_update.session.input_audio_format == fmt
    assert to_json(msg)["session"]["turn_detection"] == {"type": "none"}
    assert client_event("camera.frame", event_id="e", image=bytearray(b"\x89PNG"), mime_type="image/png") == \
        ConverseRequest(event_id="e", camera_frame={"image": b"\x89PNG", "mime_type": "image/png"})
    assert from_json({"type": "response.create", "instructions": None}) == client_event("response.create")


def test_event_error_to_event():
    with pytest.raises(EventError) as info:
        from_json({"type": "response.create", "max_output_tokens": "many"})
    assert to_json(info.value.to_event("evt_3")) == {
        "type": "error", "code": "invalid_value", "message": str(info.value), "event_id": "evt_3",
        "param": "max_output_tokens"}


# ---- bad input ----

@pytest.mark.parametrize(("obj", "code", "param", "words"), [
    ("{not json", "invalid_event", "", ["JSON"]),
    ("[1, 2]", "invalid_event", "", ["object"]),
    ({"item_id": "x"}, "invalid_event", "type", ["type"]),
    ({"type": 7}, "invalid_event", "type", ["type"]),
    ({"type": None}, "invalid_event", "type", ["type"]),
    ({"type": "response.cancle"}, "unknown_event", "type", ["response.cancle", "response.cancel"]),
    ({"type": "x" * 100_000}, "unknown_event", "type", ["unknown"]),
    ({"type": "response.done"}, "unknown_event", "type", ["response.done", "server event"]),
    ({"type": "input_audio_buffer.append", "audoi": "AAAA"}, "unknown_field", "audoi",
     ["audoi", "input_audio_buffer.append"]),
    ({"type": "session.update", "session": {"turn_detection": {"treshold": 0.5}}}, "unknown_field",
     "session.turn_detection.treshold", ["session.turn_detection.treshold", "session.update"]),
    ({"type": "conversation.item.truncate", "audio_end_ms": "1234"}, "invalid_value", "audio_end_ms",
     ["audio_end_ms", "integer"]),
    ({"type": "conversation.item.truncate", "audio_end_ms": 12.5}, "invalid_value", "audio_end_ms", ["12.5"]),
    ({"type": "conversation.item.truncate", "content_index": 2**40}, "invalid_value", "content_index",
     ["range"]),
    ({"type": "conversation.item.truncate", "audio_end_ms": True}, "invalid_value", "audio_end_ms", ["true"]),
    ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "invalid_value", "audio", ["base64"]),
    ({"type": "input_audio_buffer.append", "audio": "AAA"}, "invalid_value", "audio", ["base64"]),
    ({"type": "input_audio_buffer.append", "audio": [1, 2]}, "invalid_value", "audio", ["base64"]),
    ({"type": "session.update", "session": {"turn_detection": {"type": "vad"}}}, "invalid_value",
     "session.turn_detection.type", ["session.turn_detection.type", "'vad'", "server_vad"]),
    ({"type": "session.update", "session": {"input_audio_format": {"encoding": 1}}}, "invalid_value",
     "session.input_audio_format.encoding", ["pcm16"]),
    ({"type": "session.update", "session": "fast"}, "invalid_value", "session", ["object"]),
    ({"type": "session.update", "session": {"voice": 3}}, "invalid_value", "session.voice", ["string"]),
    ({"type": "session.update", "event_id": 5}, "invalid_value", "event_id", ["event_id"]),
    ({"type": "session.update", "session": {"input_audio_transcription": {"enabled": "yes"}}},
     "invalid_value", "session.input_audio_transcription.enabled", ["boolean"]),
])
def test_bad_client_input(obj, code, param, words):
    with pytest.raises(EventError) as info:
        from_json(obj)
    error = info.value
    assert isinstance(error, ValueError)
    assert (error.code, error.param) == (code, param), str(error)
    for word in words:
        assert word in str(error)
    assert len(str(error)) < 300


def test_client_event_sent_as_server_event():
    with pytest.raises(EventError, match="client event") as info:
        from_json({"type": "session.update"}, "server")
    assert info.value.code == "unknown_event"


def test_bad_words_list():
    obj = {"type": "conversation.item.input_audio_transcription.completed", "words": [{"start_ms": "x"}]}
    with pytest.raises(EventError) as info:
        from_json(obj, "server")
    assert (info.value.code, info.value.param) == ("invalid_value", "words[0].start_ms")
    with pytest.raises(EventError, match="array"):
        from_json({**obj, "words": {"word": "a"}}, "server")


def test_unknown_names_in_constructors():
    with pytest.raises(EventError) as info:
        server_event("response.cancel")
    assert info.value.code == "unknown_event"
    with pytest.raises(EventError) as info:
        client_event("response.create", voice="x")
    assert info.value.code == "unknown_field"
    with pytest.raises(ValueError, match="kind"):
        from_json({"type": "error"}, "both")  # type: ignore[arg-type]
