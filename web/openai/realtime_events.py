"""OpenAI Realtime API events <-> rtmedia `Converse` events (docs/openai.md#realtime).

`Translator` holds one API session's state: its config (rtmedia.web.openai.realtime_config), the
conversation's item order (`previous_item_id`), and each response's item, modality and
text. `from_client` (rtmedia.web.openai.realtime_client_events, the client's half) turns a
client event of the API into the `ConverseRequest`s it means (and any event the front answers
itself); `from_server` turns each `ConverseResponse` into
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
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rtmedia.protocol.events import to_json
from rtmedia.v1 import realtime_pb2
from rtmedia.web.audio_encode import G711Encoder
from rtmedia.web.openai.realtime_client_events import ClientEvents, Created
from rtmedia.web.openai.realtime_config import RealtimeConfig, RealtimeError

# rtmedia's error codes that are the server's own trouble, not the client's mistake.
SERVER_CODES = {"server_error", "engine_unavailable"}
CANCEL_REASONS = {"client_truncated": "client_cancelled"}  # rtmedia's reasons in the API's words
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
class Translator(ClientEvents):
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
