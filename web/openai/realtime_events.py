"""OpenAI Realtime API events <-> rtmedia `Converse` events (docs/openai.md#realtime).

`Translator` holds one API session's state: its config (rtmedia.web.openai.realtime_config), the
conversation's item order (`previous_item_id`), and each response's item, modality and
text. `from_client` turns a client event of the API into the `ConverseRequest`s it means
(and any event the front answers itself); `from_server` turns each `ConverseResponse` into
the API's server events, each with a unique `event_id`: a reply's `response.created` becomes
`response.created`, `response.output_item.added`, `conversation.item.added` and
`response.content_part.added`; its text deltas are `response.output_audio_transcript.delta`
(audio responses) or `response.output_text.delta` (text-only); its end is the `.done` events
of the part, item and response, the response object carrying `status_details` and `usage`.
A reply's function calls are `function_call` items after its message (output_index 1, 2,
...), with their argument deltas, and the client's results come back as
`function_call_output` items.

A client event's own `event_id` travels to the server, so that the server's errors name it;
where the client gave none, the front gives the events it must follow (session.update,
response.create) an id of its own, never shown to the client.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rtmedia.protocol.events import EventError, client_event, to_json
from rtmedia.v1 import realtime_pb2
from rtmedia.web.audio_encode import G711Encoder
from rtmedia.web.openai.realtime_config import (
    RealtimeConfig,
    RealtimeError,
    check_response_tools,
    max_tokens,
    modality,
    refuse,
)

OWN_ID = "rtmedia.front."  # the prefix of the event ids the front gives events the client left without one
# rtmedia's error codes that are the server's own trouble, not the client's mistake.
SERVER_CODES = {"server_error", "engine_unavailable"}
CANCEL_REASONS = {"client_truncated": "client_cancelled"}  # rtmedia's reasons in the API's words
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
                 "conversation.item.delete", "conversation.item.retrieve", "response.create", "response.cancel",
                 "output_audio_buffer.clear")
# rtmedia's error params in the API's terms, where they differ.
PARAMS = {"audio": "audio", "item_id": "item_id", "audio_end_ms": "audio_end_ms", "voice": "session.audio.output.voice",
          "instructions": "session.instructions", "item.text": "item.content", "item.id": "item.id",
          "tools": "session.tools", "tool_choice.name": "session.tool_choice", "tool_filler_ms": "session.tool_filler_ms",
          "tool_timeout_ms": "session.tool_timeout_ms", "turn_detection.type": "session.audio.input.turn_detection.type",
          "recording": "session.recording",
          "input_audio_transcription.language": "session.audio.input.transcription.language"}


@dataclass
class ResponseState:
    """One response as the API shows it."""

    id: str
    item_id: str
    modality: str
    conversation: str = "auto"
    metadata: dict[str, str] | None = None
    max_output_tokens: int = 0
    text: str = ""
    audio_started: bool = False
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # its function_call items, by item id


@dataclass
class Created:
    """What a response.create asked for, until its response.created (or its error) arrives."""

    modality: str
    conversation: str
    metadata: dict[str, str] | None
    max_output_tokens: int


@dataclass
class Translator:
    config: RealtimeConfig
    # A WebRTC call: audio travels on its tracks (PCM16 at these rates to and from the server), not in events.
    webrtc: bool = False
    track_rates: tuple[int, int] = (0, 0)
    _pending: deque[tuple[str, RealtimeConfig]] = field(default_factory=deque)  # session.update sent, not answered
    _creates: dict[str, Created] = field(default_factory=dict)  # response.create sent, not answered
    items: list[str] = field(default_factory=list)  # the conversation's item ids, in order
    _user_items: dict[str, dict[str, Any]] = field(default_factory=dict)  # user audio items until transcribed
    _audio_items: set[str] = field(default_factory=set)  # user items that were spoken
    _audio_ms: dict[str, int] = field(default_factory=dict)  # a spoken turn's length, until transcribed
    responses_seen: dict[str, str] = field(default_factory=dict)  # assistant item id -> its modality
    responses: dict[str, ResponseState] = field(default_factory=dict)
    created: bool = False  # session.created was sent
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _encoder: G711Encoder | None = None

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

    # ---- rtmedia -> the API ------------------------------------------------------------------------------
    def from_server(self, msg: realtime_pb2.ConverseResponse) -> list[dict[str, Any]]:
        """The API's events for one rtmedia event (none for what the API has no word for)."""
        kind = msg.WhichOneof("event")
        if kind == "response_output_audio_delta":  # audio stays bytes until it is encoded
            return self._audio_delta(msg.response_output_audio_delta)
        event = to_json(msg)
        handler = getattr(self, "_on_" + kind, None) if kind else None
        return handler(event) if handler is not None else []

    def _on_session_created(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        return []  # the API's session.created follows the answer to the first session.update

    def _on_session_updated(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if not self._pending:
            return []
        _, self.config = self._pending.popleft()
        session = self.config.session_object()
        if "recording" in event.get("session", {}):  # (rtmedia extension) whether the server records it
            session["recording"] = event["session"]["recording"]
        out = self._event("session.updated" if self.created else "session.created", session=session)
        self.created = True
        return [out]

    def _on_error(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        eid = event.get("event_id") or None
        if self._pending and eid == self._pending[0][0]:
            self._pending.popleft()  # that update was refused: the config stays
        if eid:
            self._creates.pop(eid, None)
        code = event.get("code") or "server_error"
        param = event.get("param") or None
        if param and param.startswith("tools.functions["):  # tools.functions[N].name -> session.tools[N].name
            param = "session.tools" + param.removeprefix("tools.functions")
        exc = RealtimeError(code, event.get("message", ""), PARAMS.get(param, param) if param else None,
                            "server_error" if code in SERVER_CODES else "invalid_request_error")
        return [self.error(exc, eid)]

    def _on_input_audio_buffer_speech_started(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("input_audio_buffer.speech_started", item_id=e["item_id"],
                            audio_start_ms=e["audio_start_ms"])]

    def _on_input_audio_buffer_speech_tentative(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        # rtmedia's extension (confirmed interruptions): voice over a reply, which is paused
        return [self._event("input_audio_buffer.speech_tentative", item_id=e["item_id"],
                            audio_start_ms=e["audio_start_ms"], response_id=e["response_id"])]

    def _on_input_audio_buffer_backchannel(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        # rtmedia's extension: the voice was no interruption; the reply goes on
        return [self._event("input_audio_buffer.backchannel", item_id=e["item_id"], transcript=e.get("transcript", ""),
                            audio_start_ms=e["audio_start_ms"], response_id=e["response_id"])]

    def _on_input_audio_buffer_dtmf_event_received(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("input_audio_buffer.dtmf_event_received", event=e["event"],
                            received_at=int(e["received_at"]))]

    def _on_input_audio_buffer_speech_stopped(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        # rtmedia's extensions: why the turn ended (silence, semantic, max_wait) and its end-of-turn score
        extra = {"score": round(e["score"], 3)} if "score" in e else {}
        return [self._event("input_audio_buffer.speech_stopped", item_id=e["item_id"], audio_end_ms=e["audio_end_ms"],
                            reason=e.get("reason"), **extra)]

    def _on_input_audio_buffer_timeout_triggered(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("input_audio_buffer.timeout_triggered", item_id=e["item_id"],
                            audio_start_ms=e["audio_start_ms"], audio_end_ms=e["audio_end_ms"])]

    def _on_input_audio_buffer_cleared(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("input_audio_buffer.cleared")]

    def _on_input_audio_buffer_committed(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        item_id, previous = e["item_id"], self._previous()
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": None}]}
        self._user_items[item_id] = item
        self._audio_ms[item_id] = e.get("audio_ms", 0)
        self._audio_items.add(item_id)
        self.items.append(item_id)
        return [self._event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous),
                self._event("conversation.item.added", previous_item_id=previous, item=item)]

    def _user_item_done(self, item_id: str, transcript: str | None) -> list[dict[str, Any]]:
        item = self._user_items.pop(item_id, None)
        if item is None:
            return []
        item["content"][0]["transcript"] = transcript
        return [self._event("conversation.item.done", previous_item_id=self._previous(item_id), item=item)]

    def _on_conversation_item_input_audio_transcription_delta(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        if self.config.transcription is None:
            return []
        return [self._event("conversation.item.input_audio_transcription.delta", item_id=e["item_id"],
                            content_index=0, delta=e["delta"])]

    def _on_conversation_item_input_audio_transcription_completed(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        if self.config.transcription is None:
            return self._user_item_done(e["item_id"], None)
        usage = {"type": "duration", "seconds": self._audio_ms.pop(e["item_id"], 0) / 1000}
        logprobs = None
        if self.config.include:
            logprobs = [{"token": t.get("token", ""), "logprob": round(t.get("logprob", 0.0), 6),
                         "bytes": list(base64.b64decode(t.get("bytes", "")))} for t in e.get("tokens", [])]
        return [self._event("conversation.item.input_audio_transcription.completed", item_id=e["item_id"],
                            content_index=0, transcript=e["transcript"], logprobs=logprobs, usage=usage),
                *self._user_item_done(e["item_id"], e["transcript"])]

    def _on_conversation_item_input_audio_transcription_failed(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._user_item_done(e["item_id"], None)
        if self.config.transcription is None:
            return out
        error = {"type": "server_error", "code": e.get("code") or "transcription_failed",
                 "message": e.get("message", ""), "param": None}
        return [self._event("conversation.item.input_audio_transcription.failed", item_id=e["item_id"],
                            content_index=0, error=error), *out]

    def _on_conversation_item_added(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        item = self._api_item(e["item"])
        previous = self._previous()
        self.items.append(item["id"])
        return [self._event("conversation.item.added", previous_item_id=previous, item=item),
                self._event("conversation.item.done", previous_item_id=previous, item=item)]

    def _on_conversation_item_deleted(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        if e["item_id"] in self.items:
            self.items.remove(e["item_id"])
        return [self._event("conversation.item.deleted", item_id=e["item_id"])]

    def _on_conversation_item_retrieved(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("conversation.item.retrieved", item=self._api_item(e["item"]))]

    def _on_conversation_item_truncated(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("conversation.item.truncated", item_id=e["item_id"], content_index=0,
                            audio_end_ms=e["audio_end_ms"])]

    def _api_item(self, item: dict[str, Any]) -> dict[str, Any]:
        """An rtmedia conversation item (canonical JSON) as the API's item: a message, a function
        call, or a function's output."""
        if item.get("type") == "function_call":
            return {"id": item["id"], "object": "realtime.item", "type": "function_call", "status": "completed",
                    "call_id": item["call_id"], "name": item["name"], "arguments": item.get("arguments", "")}
        if item.get("type") == "function_call_output":
            return {"id": item["id"], "object": "realtime.item", "type": "function_call_output",
                    "call_id": item["call_id"], "output": item.get("output", "")}
        role, text, item_id = item.get("role") or "user", item.get("text", ""), item.get("id", "")
        if role == "user":
            part = {"type": "input_audio", "transcript": text} if item_id in self._audio_items else \
                {"type": "input_text", "text": text}
        elif self.responses_seen.get(item_id) == "audio":  # a spoken reply
            part = {"type": "output_audio", "transcript": text}
        else:
            part = {"type": "output_text", "text": text}
        return {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": "completed",
                "content": [part]}

    def _previous(self, item_id: str | None = None) -> str | None:
        """The item before `item_id` (None: the last item) in the conversation."""
        if item_id is None:
            return self.items[-1] if self.items else None
        index = self.items.index(item_id) if item_id in self.items else len(self.items)
        return self.items[index - 1] if index > 0 else None

    # ---- responses ----------------------------------------------------------------------------------------
    def _on_response_created(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        asked = self._creates.pop(e.get("request_event_id") or "", None) or Created(
            self.config.output_modality, "auto", None, self.config.max_output_tokens)
        response = ResponseState(e["response_id"], e["item_id"], asked.modality, asked.conversation, asked.metadata,
                                 asked.max_output_tokens)
        self.responses[response.id] = response
        self.responses_seen[response.item_id] = response.modality
        item = self._assistant_item(response, "in_progress")
        out = [self._event("response.created", response=self._response_object(response, "in_progress")),
               self._event("rate_limits.updated", rate_limits=[
                   {"name": "tokens", "limit": response.max_output_tokens or None,
                    "remaining": response.max_output_tokens or None, "reset_seconds": 0}]),
               self._event("response.output_item.added", response_id=response.id, output_index=0, item=item)]
        if response.conversation == "auto":
            out.append(self._event("conversation.item.added", previous_item_id=self._previous(), item=item))
            self.items.append(response.item_id)
        out.append(self._event("response.content_part.added", **self._part_ids(response), part=self._part(response)))
        return out

    def _part_ids(self, response: ResponseState) -> dict[str, Any]:
        return {"response_id": response.id, "item_id": response.item_id, "output_index": 0, "content_index": 0}

    def _part(self, response: ResponseState) -> dict[str, Any]:
        if response.modality == "text":
            return {"type": "text", "text": response.text}
        return {"type": "audio", "transcript": response.text}

    def _assistant_item(self, response: ResponseState, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [
            {"type": "output_text", "text": response.text} if response.modality == "text" else
            {"type": "output_audio", "transcript": response.text}]
        return {"id": response.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def _response_object(self, response: ResponseState, status: str, details: dict[str, Any] | None = None,
                         usage: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [] if status == "in_progress" else [self._assistant_item(
            response, "completed" if status == "completed" else "incomplete"), *response.calls.values()]
        return {"id": response.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "conversation_id": None if response.conversation == "none" else self.config.id,
                "output_modalities": [response.modality], "max_output_tokens": response.max_output_tokens or "inf",
                "audio": {"output": {"format": RealtimeConfig._format(self.config.output_format),
                                     "voice": self.config.voice}},
                "metadata": response.metadata, "usage": usage}

    def _on_response_waiting(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        """(rtmedia extension) every LM slot is taken: the reply waits its turn."""
        return [self._event("response.waiting", response_id=e["response_id"], reason=e["reason"],
                            queue_position=e["queue_position"])]

    def _audio_delta(self, delta: realtime_pb2.ResponseOutputAudioDeltaEvent) -> list[dict[str, Any]]:
        response = self.responses.get(delta.response_id)
        if response is None:
            return []
        out = []
        if not response.audio_started:
            response.audio_started = True
            out.append(self._event("output_audio_buffer.started", response_id=response.id))
        if self.webrtc:
            return out
        audio = delta.audio
        if self.config.output_format != "audio/pcm":
            if self._encoder is None:
                self._encoder = G711Encoder("pcm_mulaw" if self.config.output_format == "audio/pcmu" else "pcm_alaw")
            audio = self._encoder.encode(audio)
        out.append(self._event("response.output_audio.delta", **self._part_ids(response),
                               delta=base64.b64encode(audio).decode()))
        return out

    def _on_response_output_text_delta(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        response = self.responses.get(e["response_id"])
        if response is None:
            return []
        response.text += e["delta"]
        kind = "response.output_text.delta" if response.modality == "text" else "response.output_audio_transcript.delta"
        return [self._event(kind, **self._part_ids(response), delta=e["delta"])]

    def _on_response_done(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        response = self.responses.pop(e["response_id"], None)
        if response is None:
            return []
        status, reason = e.get("status", "completed"), e.get("status_reason") or ""
        ids = self._part_ids(response)
        if response.modality == "text":
            out = [self._event("response.output_text.done", **ids, text=response.text)]
        else:
            out = [self._event("response.output_audio.done", **ids),
                   self._event("response.output_audio_transcript.done", **ids, transcript=response.text)]
        item = self._assistant_item(response, "completed" if status == "completed" else "incomplete")
        out += [self._event("response.content_part.done", **ids, part=self._part(response)),
                self._event("response.output_item.done", response_id=response.id, output_index=0, item=item)]
        if response.conversation == "auto":
            out.append(self._event("conversation.item.done", previous_item_id=self._previous(response.item_id),
                                   item=item))
        details: dict[str, Any] | None = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": CANCEL_REASONS.get(reason, reason or "client_cancelled")}
        elif status == "incomplete":
            details = {"type": "incomplete", "reason": reason or "max_output_tokens"}
        elif status == "failed":
            details = {"type": "failed", "error": {"type": "server_error", "code": "response_failed",
                                                   "message": reason}}
        usage = e.get("usage") or {}
        tokens_in, tokens_out = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
        done = self._response_object(response, status, details, {"total_tokens": tokens_in + tokens_out,
                                                                  "input_tokens": tokens_in, "output_tokens": tokens_out})
        if e.get("timings"):
            done["timings"] = e["timings"]  # (rtmedia extension) where the time to the first audio went
        out.append(self._event("response.done", response=done))
        if response.audio_started and not self.webrtc:  # a call's track says when it has played out
            out.append(self.stopped(response.id))
        return out

    def stopped(self, response_id: str) -> dict[str, Any]:
        """output_audio_buffer.stopped: the response's audio has all been sent (a WebSocket) or
        played out by the call's track (WebRTC)."""
        return self._event("output_audio_buffer.stopped", response_id=response_id)

    def _on_output_audio_buffer_cleared(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("output_audio_buffer.cleared", response_id=e["response_id"])]

    # ---- function calls -----------------------------------------------------------------------------------
    def _on_response_output_item_added(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        response = self.responses.get(e["response_id"])
        if response is None:
            return []
        item = {**self._api_item(e["item"]), "status": "in_progress"}
        response.calls[item["id"]] = item
        out = [self._event("response.output_item.added", response_id=response.id, output_index=e["output_index"],
                           item=item)]
        if response.conversation == "auto":
            out.append(self._event("conversation.item.added", previous_item_id=self._previous(), item=item))
            self.items.append(item["id"])
        return out

    def _on_response_function_call_arguments_delta(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("response.function_call_arguments.delta", response_id=e["response_id"],
                            item_id=e["item_id"], output_index=e["output_index"], call_id=e["call_id"],
                            delta=e["delta"])]

    def _on_response_function_call_arguments_done(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._event("response.function_call_arguments.done", response_id=e["response_id"],
                            item_id=e["item_id"], output_index=e["output_index"], call_id=e["call_id"],
                            name=e["name"], arguments=e["arguments"])]

    def _on_response_output_item_done(self, e: dict[str, Any]) -> list[dict[str, Any]]:
        response = self.responses.get(e["response_id"])
        if response is None:
            return []
        item = self._api_item(e["item"])
        response.calls[item["id"]] = item
        out = [self._event("response.output_item.done", response_id=response.id, output_index=e["output_index"],
                           item=item)]
        if response.conversation == "auto":
            out.append(self._event("conversation.item.done", previous_item_id=self._previous(item["id"]),
                                   item=item))
        return out


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
