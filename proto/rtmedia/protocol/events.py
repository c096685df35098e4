"""Canonical JSON events (docs/protocol.md#events) <-> ConverseRequest / ConverseResponse.

The CLI's --json output, the WebRTC bridge's data channel and the browser page
all convert through this module. An event is `{"type": "<dotted name>", ...}`
with the event message's fields at the top level, plus `event_id` when set:

- nested messages are objects, repeated fields lists;
- bytes are base64 (standard alphabet, padded), int64 plain JSON numbers;
- enums are short lowercase names without the enum's prefix
  (`TURN_DETECTION_TYPE_SERVER_VAD` -> "server_vad");
- float32 fields use their shortest repr that round-trips (0.3, not 0.30000001...);
- `optional` fields appear only when set; plain scalars always appear on server
  events (so clients see `"channels": 1`, `"played_ms": 0`) and only when
  non-zero on client events; null in input JSON means "not set".

`error` has its own `event_id` field (the client event it refers to): there the
JSON `event_id` key is that field, and the envelope's `event_id` is not shown.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import json
import math
import re
import struct
from functools import cache
from typing import Any, Literal

from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from rtmedia.v1.realtime_pb2 import ConverseRequest, ConverseResponse

Kind = Literal["client", "server"]

# Client -> server: event name -> ConverseRequest.event oneof member.
CLIENT_EVENTS: dict[str, str] = {
    "session.update": "session_update",
    "input_audio_buffer.append": "input_audio_buffer_append",
    "input_audio_buffer.commit": "input_audio_buffer_commit",
    "input_audio_buffer.clear": "input_audio_buffer_clear",
    "conversation.item.create": "conversation_item_create",
    "conversation.item.truncate": "conversation_item_truncate",
    "conversation.item.delete": "conversation_item_delete",
    "conversation.item.retrieve": "conversation_item_retrieve",
    "response.create": "response_create",
    "response.cancel": "response_cancel",
    "playback.ack": "playback_ack",  # (ext)
    "camera.frame": "camera_frame",  # (ext)
    "session.close": "session_close",  # (ext)
    "input_audio_buffer.dtmf": "input_audio_buffer_dtmf",  # (ext)
}

# Server -> client: event name -> ConverseResponse.event oneof member.
SERVER_EVENTS: dict[str, str] = {
    "session.created": "session_created",
    "session.updated": "session_updated",
    "input_audio_buffer.speech_started": "input_audio_buffer_speech_started",
    "input_audio_buffer.speech_stopped": "input_audio_buffer_speech_stopped",
    "input_audio_buffer.committed": "input_audio_buffer_committed",
    "input_audio_buffer.cleared": "input_audio_buffer_cleared",
    "input_audio_buffer.timeout_triggered": "input_audio_buffer_timeout_triggered",
    "input_audio_buffer.speech_tentative": "input_audio_buffer_speech_tentative",  # (ext)
    "input_audio_buffer.backchannel": "input_audio_buffer_backchannel",  # (ext)
    "input_audio_buffer.dtmf_event_received": "input_audio_buffer_dtmf_event_received",
    "conversation.item.added": "conversation_item_added",
    "conversation.item.deleted": "conversation_item_deleted",
    "conversation.item.retrieved": "conversation_item_retrieved",
    "conversation.item.truncated": "conversation_item_truncated",
    "conversation.item.input_audio_transcription.delta": "conversation_item_input_audio_transcription_delta",
    "conversation.item.input_audio_transcription.completed":
        "conversation_item_input_audio_transcription_completed",
    "conversation.item.input_audio_transcription.failed": "conversation_item_input_audio_transcription_failed",
    "response.created": "response_created",
    "response.output_audio.delta": "response_output_audio_delta",
    "response.output_text.delta": "response_output_text_delta",
    "response.output_text.done": "response_output_text_done",
    "response.output_audio.done": "response_output_audio_done",
    "response.done": "response_done",
    "response.output_item.added": "response_output_item_added",
    "response.output_item.done": "response_output_item_done",
    "response.function_call_arguments.delta": "response_function_call_arguments_delta",
    "response.function_call_arguments.done": "response_function_call_arguments_done",
    "response.waiting": "response_waiting",  # (ext)
    "output_audio_buffer.cleared": "output_audio_buffer_cleared",
    "playback.acknowledged": "playback_acknowledged",  # (ext)
    "session.closed": "session_closed",  # (ext)
    "error": "error",
}

_TABLES: dict[str, tuple[type[Message], dict[str, str]]] = {
    "client": (ConverseRequest, CLIENT_EVENTS),
    "server": (ConverseResponse, SERVER_EVENTS),
}
_NAMES: dict[type[Message], dict[str, str]] = {
    ConverseRequest: {member: name for name, member in CLIENT_EVENTS.items()},
    ConverseResponse: {member: name for name, member in SERVER_EVENTS.items()},
}
_JSON_TYPES = {str: "a string", list: "an array", tuple: "an array", dict: "an object", type(None): "null"}
_F = FieldDescriptor


class EventError(ValueError):
    """An event that cannot be converted. `code` and `param` are meant for the `error` event."""

    def __init__(self, code: str, message: str, param: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def to_event(self, event_id: str = "") -> ConverseResponse:
        """The `error` event reporting this problem (`event_id`: the offending client event's id)."""
        return server_event("error", code=self.code, message=self.message, event_id=event_id, param=self.param)


# ---- proto -> JSON ----

def event_type(msg: ConverseRequest | ConverseResponse) -> str:
    """The dotted name of the event set in `msg`, or "" if none is set."""
    member = msg.WhichOneof("event")
    return _NAMES[type(msg)][member] if member else ""


def to_json(msg: ConverseRequest | ConverseResponse) -> dict[str, Any]:
    """The canonical JSON object of an event."""
    name = event_type(msg)
    if not name:
        raise EventError("invalid_event", f"{type(msg).__name__} has no event set")
    out: dict[str, Any] = {"type": name}
    if msg.event_id:
        out["event_id"] = msg.event_id
    out.update(_to_dict(getattr(msg, msg.WhichOneof("event")), isinstance(msg, ConverseResponse)))
    return out


def dumps(msg: ConverseRequest | ConverseResponse) -> str:
    """The canonical JSON of an event as one compact line."""
    return json.dumps(to_json(msg), separators=(",", ":"), ensure_ascii=False)


def _to_dict(msg: Message, defaults: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.is_repeated:
            if value or defaults:
                out[fd.name] = [_to_value(fd, item, defaults) for item in value]
        elif fd.has_presence:
            if msg.HasField(fd.name):
                out[fd.name] = _to_value(fd, value, defaults)
        elif value or defaults:
            out[fd.name] = _to_value(fd, value, defaults)
    return out


def _to_value(fd: FieldDescriptor, value: Any, defaults: bool) -> Any:
    if fd.type == _F.TYPE_MESSAGE:
        return _to_dict(value, defaults)
    if fd.type == _F.TYPE_ENUM:
        return _enum_names(fd.enum_type)[1].get(value, value)  # an unknown number stays a number
    if fd.type == _F.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    if fd.type == _F.TYPE_FLOAT:
        return _float32(value)
    return value


def _float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32."""
    if not math.isfinite(value):
        return value
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", short))[0] == value:
            return short
    return value


@cache
def _enum_names(enum: EnumDescriptor) -> tuple[dict[str, int], dict[int, str]]:
    """Short names of an enum: TurnDetectionType.TURN_DETECTION_TYPE_SERVER_VAD <-> "server_vad"."""
    prefix = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", enum.name).upper() + "_"
    by_number = {v.number: v.name.removeprefix(prefix).lower() for v in enum.values}
    return {short: number for number, short in by_number.items()}, by_number


# ---- JSON -> proto ----

def from_json(obj: dict[str, Any] | str | bytes, kind: Kind = "client") -> ConverseRequest | ConverseResponse:
    """Parse a canonical JSON event (a dict or its text); raises EventError on bad input."""
    if isinstance(obj, str | bytes):
        try:
            obj = json.loads(obj)
        except ValueError as exc:
            raise EventError("invalid_event", f"event is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise EventError("invalid_event", f"an event must be a JSON object, not {_json_type(obj)}")
    name = obj.get("type")
    if not isinstance(name, str):
        problem = "has no" if name is None else "has a non-string"
        raise EventError("invalid_event", f"event {problem} 'type'", "type")
    return _build(kind, name, {k: v for k, v in obj.items() if k != "type"}, native=False)


def client_event(name: str, /, event_id: str = "", **fields: Any) -> ConverseRequest:
    """A ConverseRequest for event `name`; fields take Python values (bytes, nested dicts or messages)."""
    return _build("client", name, {"event_id": event_id, **fields} if event_id else fields, native=True)


def server_event(name: str, /, event_id: str = "", **fields: Any) -> ConverseResponse:
    """A ConverseResponse for event `name`, e.g. server_event("response.done", response_id=r, status="cancelled").

    For `error`, `event_id` is the error's own field (the client event it refers to).
    """
    return _build("server", name, {"event_id": event_id, **fields} if event_id else fields, native=True)


def _build(kind: Kind, name: str, fields: dict[str, Any], native: bool) -> Any:
    if kind not in _TABLES:
        raise ValueError(f"kind must be 'client' or 'server', not {kind!r}")
    envelope_type, table = _TABLES[kind]
    member = table.get(name)
    if member is None:
        other = "server" if kind == "client" else "client"
        if name in _TABLES[other][1]:
            raise EventError("unknown_event", f"{name!r} is a {other} event, not a {kind} event", "type")
        hint = difflib.get_close_matches(name, table, n=1) if len(name) <= 100 else []
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise EventError("unknown_event", f"unknown {kind} event type {_clip(name)}{suggestion}", "type")
    envelope = envelope_type()
    event = getattr(envelope, member)
    event.SetInParent()
    if "event_id" in fields and "event_id" not in event.DESCRIPTOR.fields_by_name:
        fields = dict(fields)
        event_id = fields.pop("event_id")
        if not isinstance(event_id, str | None):
            raise _invalid("event_id", name, f"expected a string, got {_json_type(event_id)}")
        envelope.event_id = event_id or ""
    _fill(event, fields, "", name, native)
    return envelope


def _fill(msg: Message, fields: dict[str, Any], prefix: str, event: str, native: bool) -> None:
    for key, value in fields.items():
        path = f"{prefix}{key}"
        fd = msg.DESCRIPTOR.fields_by_name.get(key)
        if fd is None:
            raise EventError("unknown_field", f"unknown field {_clip(path)} in {event}", path[:200])
        if value is None:
            continue
        if fd.is_repeated:
            if not isinstance(value, list | tuple):
                raise _invalid(path, event, f"expected an array, got {_json_type(value)}")
            for i, item in enumerate(value):
                if fd.type == _F.TYPE_MESSAGE:
                    _fill_message(getattr(msg, key).add(), item, f"{path}[{i}]", event, native)
                else:
                    _set(msg, fd, _scalar(fd, item, f"{path}[{i}]", event, native), f"{path}[{i}]", event)
        elif fd.type == _F.TYPE_MESSAGE:
            _fill_message(getattr(msg, key), value, path, event, native)
        else:
            _set(msg, fd, _scalar(fd, value, path, event, native), path, event)


def _fill_message(target: Message, value: Any, path: str, event: str, native: bool) -> None:
    if native and isinstance(value, Message) and value.DESCRIPTOR is target.DESCRIPTOR:
        target.CopyFrom(value)
        return
    if not isinstance(value, dict):
        raise _invalid(path, event, f"expected an object, got {_json_type(value)}")
    target.SetInParent()
    _fill(target, value, path + ".", event, native)


def _set(msg: Message, fd: FieldDescriptor, value: Any, path: str, event: str) -> None:
    try:
        if fd.is_repeated:
            getattr(msg, fd.name).append(value)
        else:
            setattr(msg, fd.name, value)
    except (TypeError, ValueError) as exc:  # e.g. out of range for an int32
        raise _invalid(path, event, str(exc)) from exc


def _scalar(fd: FieldDescriptor, value: Any, path: str, event: str, native: bool) -> Any:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if fd.type == _F.TYPE_BYTES:
        if native and isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise _invalid(path, event, "expected base64 (standard alphabet, padded)") from None
        expected = "a base64 string"
    elif fd.type == _F.TYPE_ENUM:
        by_short = _enum_names(fd.enum_type)[0]
        if isinstance(value, str) and value in by_short:
            return by_short[value]
        if native and isinstance(value, int) and not isinstance(value, bool):
            return value
        expected = "one of " + ", ".join(repr(short) for short in by_short)
        if isinstance(value, str):
            raise _invalid(path, event, f"expected {expected}, got {_clip(value)}")
    elif fd.type == _F.TYPE_BOOL:
        if isinstance(value, bool):
            return value
        expected = "a boolean"
    elif fd.type == _F.TYPE_STRING:
        if isinstance(value, str):
            return value
        expected = "a string"
    elif fd.type in (_F.TYPE_FLOAT, _F.TYPE_DOUBLE):
        if number:
            return float(value)
        expected = "a number"
    else:
        if number and (isinstance(value, int) or value.is_integer()):  # every integer type
            return int(value)
        expected = "an integer"
    raise _invalid(path, event, f"expected {expected}, got {_json_type(value)}")


def _invalid(path: str, event: str, detail: str) -> EventError:
    return EventError("invalid_value", f"invalid value for {path} in {event}: {detail}", path)


def _json_type(value: Any) -> str:
    if isinstance(value, int | float):  # bool too: show the value itself
        return json.dumps(value)
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _clip(text: str, limit: int = 64) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
