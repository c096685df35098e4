"""The typed events of rtmedia.clients.events: generated fresh from the proto, one class per
server event, their properties the payload's fields; and the sample conversion of send_audio."""

from __future__ import annotations

import numpy as np
import pytest
from rtmedia.clients import events
from rtmedia.clients.audio_file import pcm16
from rtmedia.clients.events_gen import main as events_gen
from rtmedia.protocol.events import SERVER_EVENTS, server_event, to_json
from rtmedia.v1.realtime_pb2 import ConverseResponse


def test_the_generated_module_is_fresh():
    assert events_gen(["--check"]) == 0, "run: python -m rtmedia.clients.events_gen"


def test_one_class_per_server_event():
    assert {cls.type: cls.member for cls in events.EVENT_CLASSES.values()} == SERVER_EVENTS
    assert set(events.BY_TYPE) == set(SERVER_EVENTS)


def _distinct(payload, salt: int) -> dict:
    """A distinct non-default value for each scalar field of `payload` (so a property reading the
    wrong field shows)."""
    values = {}
    for n, field in enumerate(payload.DESCRIPTOR.fields, salt):
        if field.is_repeated or field.type == field.TYPE_MESSAGE:
            continue
        if field.type == field.TYPE_ENUM:
            values[field.name] = field.enum_type.values[-1].number
        elif field.type == field.TYPE_STRING:
            values[field.name] = f"{field.name}-{n}"
        elif field.type == field.TYPE_BYTES:
            values[field.name] = bytes([n % 256, 1])
        elif field.type == field.TYPE_BOOL:
            values[field.name] = True
        elif field.type in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
            values[field.name] = n + 0.5
        else:
            values[field.name] = n + 7
    return values


@pytest.mark.parametrize("name", sorted(SERVER_EVENTS))
def test_each_event_wraps_its_payload(name):
    member = SERVER_EVENTS[name]
    msg = ConverseResponse()
    payload = getattr(msg, member)
    payload.SetInParent()
    for key, value in _distinct(payload, salt=len(name)).items():
        setattr(payload, key, value)
    event = events.wrap(msg)
    assert type(event).type == name and event.proto is msg and event.data == payload
    for field in payload.DESCRIPTOR.fields:
        assert getattr(event, field.name) == getattr(payload, field.name), field.name
    assert event.to_json() == to_json(msg) and event == events.wrap(msg)


def test_fields_read_through_to_the_message():
    msg = server_event("response.output_audio.delta", response_id="resp_1", audio=b"\x01\x00", sample_rate=24000,
                       channels=1)
    event = events.wrap(msg)
    assert isinstance(event, events.ResponseOutputAudioDeltaEvent)
    assert (event.response_id, event.audio, event.sample_rate) == ("resp_1", b"\x01\x00", 24000)
    error = events.wrap(server_event("error", code="invalid_value", message="bad", event_id="evt_9", param="voice"))
    assert (error.code, error.message, error.event_id, error.param) == ("invalid_value", "bad", "evt_9", "voice")
    assert "ErrorEvent" in repr(error)
    assert type(events.wrap(ConverseResponse())) is events.ServerEvent


def test_pcm16_takes_bytes_ints_and_floats():
    assert pcm16(b"\x01\x02") == b"\x01\x02"
    assert pcm16(np.array([1, -2], np.int16)) == b"\x01\x00\xfe\xff"
    assert pcm16(np.array([0.0, 1.0, -2.0], np.float32)) == np.array([0, 32767, -32768], "<i2").tobytes()
    assert pcm16(np.array([70000], np.int32)) == np.array([32767], "<i2").tobytes()
    with pytest.raises(TypeError, match="numpy array of samples"):
        pcm16(np.array(["a"]))
