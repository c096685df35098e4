"""The client's half of the Realtime API's translation (rtmedia.web.openai.realtime_events):
`ClientEvents.from_client` turns a client event of the API into the `ConverseRequest`s it means,
checking its fields as the API does and refusing, in the API's error shape, what rtmedia does
not do; `error` is the API's error event. `Translator` adds the server's half and holds the
state both read (the conversation's items, the session.updates and response.creates sent).

A client event's own `event_id` travels to the server, so that the server's errors name it;
where the client gave none, the front gives the events it must follow (session.update,
response.create) an id of its own (OWN_ID), never shown to the client.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rtmedia.protocol.events import EventError, client_event
from rtmedia.v1 import realtime_pb2
from rtmedia.web.openai.realtime_config import (
    RealtimeConfig,
    RealtimeError,
    check_response_tools,
    max_tokens,
    modality,
    refuse,
)

if TYPE_CHECKING:
    from rtmedia.web.openai.realtime_events import ResponseState

OWN_ID = "rtmedia.front."  # the prefix of the event ids the front gives events the client left without one
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
                 "conversation.item.delete", "conversation.item.retrieve", "response.create", "response.cancel",
                 "output_audio_buffer.clear")


@dataclass
class Created:
    """What a response.create asked for, until its response.created (or its error) arrives."""

    modality: str
    conversation: str
    metadata: dict[str, str] | None
    max_output_tokens: int


class ClientEvents:
    """The client -> rtmedia half of `Translator` (a dataclass that holds the fields below)."""

    config: RealtimeConfig
    webrtc: bool
    track_rates: tuple[int, int]
    _pending: deque[tuple[str, RealtimeConfig]]
    _creates: dict[str, Created]
    items: list[str]
    _audio_items: set[str]
    responses: dict[str, ResponseState]
    _ids: Any

    def event_id(self) -> str:
        return f"event_{self.config.id[-8:]}_{next(self._ids)}"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": self.event_id(), **fields}

    def error(self, exc: RealtimeError, client_event_id: str | None = None) -> dict[str, Any]:
        """The API's error event for `exc` about the client event `client_event_id`."""
        if client_event_id is not None and client_event_id.startswith(OWN_ID):
            client_event_id = None
        return self._event("error", error={"type": exc.type, "code": exc.code, "message": exc.message,
                                           "param": exc.param, "event_id": client_event_id})

    # ---- client -> rtmedia ------------------------------------------------------------------------------
    def initial(self) -> realtime_pb2.ConverseRequest:
        """The first request: the API's default session, in rtmedia's terms."""
        eid = OWN_ID + "initial"
        self._pending.append((eid, self.config))
        return client_event("session.update", eid, session=self._rtmedia(self.config))

    def _rtmedia(self, config: RealtimeConfig) -> dict[str, Any]:
        session = config.to_rtmedia()
        if self.webrtc:
            session["input_audio_format"] = {"encoding": "pcm16", "sample_rate": self.track_rates[0], "channels": 1}
            session["output_sample_rate"] = self.track_rates[1]
        return session

    def from_client(self, event: Any) -> tuple[list[realtime_pb2.ConverseRequest], list[dict[str, Any]]]:
        """The requests a client event means, and the events the front answers at once. Raises
        RealtimeError (with `event_id` on the exception: the client's) for an event it refuses."""
        if not isinstance(event, dict):
            raise RealtimeError("invalid_event", f"an event must be a JSON object, not {type(event).__name__}")
        kind, eid = event.get("type"), event.get("event_id")
        if eid is not None and not isinstance(eid, str):
            raise RealtimeError("invalid_value", "event_id must be a string", "event_id")
        try:
            if not isinstance(kind, str):
                raise RealtimeError("invalid_event", "the event has no string 'type'", "type")
            if kind not in CLIENT_EVENTS:
                raise RealtimeError("unknown_event", f"unknown client event type {kind[:64]!r}; this API takes: "
                                    + ", ".join(CLIENT_EVENTS), "type")
            handler: Callable[[dict[str, Any], str], Any] = getattr(self, "_" + kind.replace(".", "_"))
            result = handler(event, eid or "")
        except EventError as exc:
            raise _with_id(RealtimeError(exc.code, exc.message, exc.param or None), eid) from exc
        except RealtimeError as exc:
            raise _with_id(exc, eid) from None
        return result if isinstance(result, tuple) else ([result] if result is not None else [], [])

    def _session_update(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"session"})
        config = self.config.updated(event.get("session"))
        if self.webrtc and (config.input_format, config.output_format) != (self.config.input_format,
                                                                           self.config.output_format):
            raise refuse("session.audio.input.format", "another audio format on a WebRTC call (its tracks carry "
                         "the audio as Opus)")
        eid = eid or f"{OWN_ID}update.{next(self._ids)}"
        self._pending.append((eid, config))
        return client_event("session.update", eid, session=self._rtmedia(config))

    def _input_audio_buffer_append(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"audio"})
        if self.webrtc:
            raise refuse("type", "input_audio_buffer.append on a WebRTC call (its microphone track carries the "
                         "audio)")
        audio = _base64(event.get("audio"), "audio")
        if not audio:
            raise RealtimeError("invalid_value", "input_audio_buffer.append: audio is empty", "audio")
        return client_event("input_audio_buffer.append", eid, audio=audio)

    def _input_audio_buffer_commit(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, set())
        return client_event("input_audio_buffer.commit", eid)

    def _input_audio_buffer_clear(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, set())
        return client_event("input_audio_buffer.clear", eid)

    def _conversation_item_create(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"item", "previous_item_id"})
        previous = event.get("previous_item_id")
        if previous is not None and previous != (self.items[-1] if self.items else None):
            raise refuse("previous_item_id", "inserting an item anywhere but at the end of the conversation")
        item = event.get("item")
        if not isinstance(item, dict):
            raise RealtimeError("invalid_value", "conversation.item.create: item must be an object", "item")
        if item.get("type") in ("function_call", "function_call_output"):
            return client_event("conversation.item.create", eid, item=_call_item(item))
        if item.get("type", "message") != "message":
            raise RealtimeError("invalid_value", "item.type must be message, function_call or function_call_output",
                                "item.type")
        _fields(item, {"id", "type", "role", "content", "status", "object"}, "item.")
        role = item.get("role")
        if role == "system":
            raise refuse("item.role", "system messages in the conversation (set session.instructions)")
        if role not in ("user", "assistant"):
            raise RealtimeError("invalid_value", "item.role must be user or assistant", "item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise RealtimeError("invalid_value", "item.content must be a non-empty list of parts", "item.content")
        texts, audio = [], b""
        allowed = {"input_text", "input_audio"} if role == "user" else {"output_text", "text", "output_audio"}
        for i, part in enumerate(content):
            param = f"item.content[{i}]"
            if not isinstance(part, dict):
                raise RealtimeError("invalid_value", f"{param} must be an object", param)
            kind = part.get("type")
            if kind == "input_image":
                raise refuse(param + ".type", "image input")
            if kind not in allowed:
                raise RealtimeError("invalid_value", f"{param}.type must be one of {', '.join(sorted(allowed))} for "
                                    f"a {role} item", param + ".type")
            if kind == "input_audio" and part.get("audio") is not None:
                audio += _base64(part["audio"], param + ".audio")
            elif kind == "output_audio" and part.get("audio") is not None:
                raise refuse(param + ".audio", "assistant audio in a created item (give its transcript)")
            else:
                text = part.get("text") if kind != "output_audio" else part.get("transcript")
                if kind == "input_audio":
                    text = part.get("transcript")
                if not isinstance(text, str):
                    raise RealtimeError("invalid_value", f"{param} has no text", param)
                texts.append(text)
        if audio and any(texts):
            raise refuse("item.content", "audio and text in one item")
        fields: dict[str, Any] = {"role": role, "text": " ".join(t for t in texts if t), "audio": audio}
        if item.get("id") is not None:
            if not isinstance(item["id"], str):
                raise RealtimeError("invalid_value", "item.id must be a string", "item.id")
            fields["id"] = item["id"]
        if audio:  # the server's items carry text only: the front remembers which were spoken
            fields.setdefault("id", f"item_{secrets.token_hex(8)}")
            self._audio_items.add(fields["id"])
        return client_event("conversation.item.create", eid, item=fields)

    def _conversation_item_truncate(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"item_id", "content_index", "audio_end_ms"})
        if event.get("content_index", 0) != 0:
            raise RealtimeError("invalid_value", "content_index must be 0: an assistant item has one audio part",
                                "content_index")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int):
            raise RealtimeError("invalid_value", "audio_end_ms must be an integer", "audio_end_ms")
        return client_event("conversation.item.truncate", eid, item_id=_string(event, "item_id"), audio_end_ms=end)

    def _conversation_item_delete(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"item_id"})
        return client_event("conversation.item.delete", eid, item_id=_string(event, "item_id"))

    def _conversation_item_retrieve(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"item_id"})
        return client_event("conversation.item.retrieve", eid, item_id=_string(event, "item_id"))

    def _response_create(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"response"})
        if self.config.type == "transcription":
            raise RealtimeError("invalid_state", "a transcription session makes no responses")
        spec = event.get("response") or {}
        if not isinstance(spec, dict):
            raise RealtimeError("invalid_value", "response must be an object", "response")
        _fields(spec, {"instructions", "max_output_tokens", "output_modalities", "conversation", "metadata", "audio",
                       "input", "tools", "tool_choice", "prompt", "parallel_tool_calls", "reasoning"}, "response.")
        check_response_tools(spec)
        for name, what in (("input", "input items for a response"), ("prompt", "prompt templates"),
                           ("reasoning", "reasoning")):
            if spec.get(name) is not None:
                raise refuse(f"response.{name}", what)
        fields: dict[str, Any] = {}
        if spec.get("instructions") is not None:
            if not isinstance(spec["instructions"], str):
                raise RealtimeError("invalid_value", "response.instructions must be a string", "response.instructions")
            fields["instructions"] = spec["instructions"]
        tokens = self.config.max_output_tokens
        if spec.get("max_output_tokens") is not None:
            tokens = fields["max_output_tokens"] = max_tokens(spec["max_output_tokens"], "response.max_output_tokens")
        mode = self.config.output_modality
        if spec.get("output_modalities") is not None:
            mode = fields["output_modality"] = modality(spec["output_modalities"], "response.output_modalities")
        conversation = spec.get("conversation", "auto") or "auto"
        if conversation not in ("auto", "none"):
            raise refuse("response.conversation", "a conversation other than auto or none")
        fields["conversation"] = conversation
        metadata = spec.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise RealtimeError("invalid_value", "response.metadata: at most 16 string keys (64 characters) and "
                                "values (512)", "response.metadata")
        audio = spec.get("audio")
        if audio is not None:
            self._check_response_audio(audio)
        eid = eid or f"{OWN_ID}response.{next(self._ids)}"
        self._creates[eid] = Created(mode, conversation, metadata, tokens)
        return client_event("response.create", eid, **fields)

    def _check_response_audio(self, audio: Any) -> None:
        """A response's own audio settings: rtmedia speaks every reply of a session in its voice and format."""
        out = audio.get("output") if isinstance(audio, dict) else None
        if not isinstance(out, dict) or set(audio) - {"output"} or set(out) - {"voice", "format"}:
            raise RealtimeError("invalid_value", "response.audio must be {output: {voice, format}}", "response.audio")
        if out.get("voice") not in (None, self.config.voice):
            raise refuse("response.audio.output.voice", "a voice per response (set session.audio.output.voice)")
        fmt = out.get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != self.config.output_format):
            raise refuse("response.audio.output.format", "a format per response (set session.audio.output.format)")

    def _response_cancel(self, event: dict[str, Any], eid: str) -> realtime_pb2.ConverseRequest:
        _fields(event, {"response_id"})
        rid = event.get("response_id") or ""
        if not isinstance(rid, str):
            raise RealtimeError("invalid_value", "response_id must be a string", "response_id")
        return client_event("response.cancel", eid, response_id=rid)

    def _output_audio_buffer_clear(self, event: dict[str, Any], eid: str
                                   ) -> tuple[list[realtime_pb2.ConverseRequest], list[dict[str, Any]]]:
        """Stop the reply's audio: the response in flight is cancelled (the server then clears the
        output buffer); with none in flight, the buffer is already empty."""
        _fields(event, set())
        generating = [r for r in self.responses.values() if r.audio_started]
        if generating:
            return [client_event("response.cancel", eid)], []
        return [], [self._event("output_audio_buffer.cleared", response_id=None)]


def _call_item(item: dict[str, Any]) -> dict[str, Any]:
    """A function_call_output (the client's result of a call) or function_call item of the API
    as rtmedia's conversation item."""
    kind = item["type"]
    names = ("call_id", "output") if kind == "function_call_output" else ("call_id", "name", "arguments")
    _fields(item, {"id", "type", "object", "status", *names}, "item.")
    fields: dict[str, Any] = {"type": kind}
    for name in ("id", *names):
        value = item.get(name)
        if value is None and name != "id":
            raise RealtimeError("missing_required_parameter", f"a {kind} item needs item.{name}", f"item.{name}")
        if value is not None and not isinstance(value, str):
            raise RealtimeError("invalid_value", f"item.{name} must be a string", f"item.{name}")
        if value is not None:
            fields[name] = value
    return fields


def _with_id(exc: RealtimeError, eid: Any) -> RealtimeError:
    exc.event_id = eid if isinstance(eid, str) else None  # type: ignore[attr-defined]
    return exc


def _fields(obj: dict[str, Any], allowed: set[str], prefix: str = "") -> None:
    for key in obj:
        if key not in allowed and (prefix or key not in ("type", "event_id")):
            raise RealtimeError("unknown_parameter", f"unknown parameter {prefix}{str(key)[:64]}", f"{prefix}{key}"[:200])


def _string(event: dict[str, Any], name: str) -> str:
    value = event.get(name)
    if not isinstance(value, str) or not value:
        raise RealtimeError("invalid_value", f"{name} must be a non-empty string", name)
    return value


def _base64(value: Any, param: str) -> bytes:
    if not isinstance(value, str):
        raise RealtimeError("invalid_value", f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("invalid_value", f"{param} is not valid base64", param) from None
