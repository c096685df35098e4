"""A session's conversation items (docs/protocol.md#conversation-items): create, delete, retrieve, truncate.

The history (`Session.history`, what the responders see) is a list of messages, each with
the id of the item it is: a user turn's transcript under its turn's id, a reply as far as it
was heard under its response's item id, a created item under its own. `ConversationItems`
(one per session, a part of it like the reply pipeline, seeing it through `ItemsHost`) serves the client events that name
items:

- conversation.item.create: a typed text item joins the history at once, and so do a
  function call's output (`function_call_output`, for a call a response made: it answers the
  call, server/session/tool_calls.py) and a function call the client records itself; an audio item
  (user audio in the session's input format) is transcribed first, by a recogniser stream of
  its own (so it never splits a turn being spoken), and joins with its transcript, after
  conversation.item.input_audio_transcription.completed. Either way conversation.item.added
  says where it went. A client id is used as it is (unique, at most `max_id_bytes`); else the
  server makes one.
- conversation.item.delete: the item leaves the history, so no later reply sees it (an LM's
  kept KV slot needs no more: the lane reuses only the prompt's unchanged prefix).
- conversation.item.retrieve: the item as the history holds it (text; audio is not kept).
- conversation.item.truncate: the user heard a reply only up to a point (conversation.item.truncated).

An item not in the history yet (a turn being spoken or transcribed, a reply being generated)
can be neither deleted nor retrieved (`invalid_state`); an unknown id is `item_not_found`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from rtmedia.engines.responders.contract import FunctionCall, Message
from rtmedia.server.hearing.audio_input import BYTES_PER_SAMPLE, recognizer_pcm
from rtmedia.server.hearing.recognition import Delta, Fault, Recognition, Recognizer, Transcribed, Turn
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.session.config import TOOL_NAME
from rtmedia.server.session.tool_calls import Call

if TYPE_CHECKING:
    from rtmedia.server.hearing.audio_input import AudioInput
    from rtmedia.server.lanes.access import EngineAccess
    from rtmedia.server.lanes.clock import Clock
    from rtmedia.server.session.config import SessionSettings
    from rtmedia.server.session.idle_turns import IdleTurns
    from rtmedia.server.session.limits import Limits
    from rtmedia.server.session.reply import ReplyPipeline, Response
    from rtmedia.server.session.tool_calls import ToolCalls
    from rtmedia.server.session.transcripts import Transcripts


class ItemsHost(Protocol):
    """What the conversation items see of their session: the history and the turns and replies
    on their way (an item may not be touched before it joins), the parts an item hands work to
    (the reply pipeline, the tool wait, the idle turns, the transcription events), and how to
    answer the client."""

    id: str
    settings: SessionSettings
    limits: Limits
    access: EngineAccess
    clock: Clock
    history: list[Message]
    client_ids: set[str]
    turn: Turn | None
    pending_turns: deque[Turn]
    input: AudioInput
    replies: ReplyPipeline
    tools: ToolCalls
    idle: IdleTurns
    transcripts: Transcripts

    @property
    def response(self) -> Response | None: ...
    def send(self, name: str, /, **fields: Any) -> None: ...
    def error(self, code: str, message: str, event_id: str = "", param: str = "") -> None: ...
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...
    def track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]: ...
    def new_id(self, prefix: str) -> str: ...
    def close_if_drained(self) -> None: ...


def item_of(message: Message) -> dict[str, str]:
    """A history message as the item events carry it: a turn's words, a function call, or a
    function's output."""
    if message.call is not None:
        call = message.call
        return {"id": message.item_id, "type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments}
    if message.role == "tool":
        return {"id": message.item_id, "type": "function_call_output", "call_id": message.call_id,
                "output": message.text}
    return {"id": message.item_id, "role": message.role, "text": message.text}


class ConversationItems:
    """The item events of one session; see the module docstring."""

    def __init__(self, session: ItemsHost) -> None:
        self.session = session
        self._recognizer: Recognizer | None = None  # the audio items', opened with the first
        self._asr_samples = 0  # 16 kHz samples sent to it
        self._order = asyncio.Lock()  # audio items reach their recogniser in the order they came

    # ---- the history -------------------------------------------------------
    @property
    def history(self) -> list[Message]:
        return self.session.history

    def index(self, item_id: str) -> int | None:
        """Where the item is in the history, or None."""
        return next((n for n, m in enumerate(self.history) if m.item_id == item_id), None)

    def ids(self) -> set[str]:
        """Every item id the session knows: in the history, turns on their way, replies."""
        s = self.session
        turns = [t for t in (s.turn, *s.pending_turns) if t is not None]
        return {m.item_id for m in self.history} | {t.item_id for t in turns} | \
            {r.item_id for r in s.replies.responses.values()}

    def _pending(self, item_id: str) -> str | None:
        """Why an item is not in the history yet, or None."""
        s = self.session
        if s.response is not None and not s.response.done and s.response.item_id == item_id:
            return "is a reply still being generated"
        if any(t is not None and t.item_id == item_id for t in (s.turn, *s.pending_turns)):
            return "is a user turn still being spoken or transcribed"
        return None

    def add(self, message: Message) -> None:
        """A created item joins the history: conversation.item.added says after which item."""
        previous = self.history[-1].item_id if self.history else ""
        self.history.append(message)
        self.session.send("conversation.item.added", previous_item_id=previous, item=item_of(message))

    # ---- client events -----------------------------------------------------
    def create(self, event: Any, event_id: str) -> None:
        s, item = self.session, event.item
        limits = s.limits
        role = item.role or "user"
        problem: tuple[str, str, str] | None = None  # (code, message, param)
        if item.type in ("function_call", "function_call_output"):
            self._create_call_item(item, event_id)
            return
        if item.type not in ("", "message"):
            problem = "invalid_value", (f"type {item.type[:32]!r} must be message, function_call or "
                                        "function_call_output"), "item.type"
        elif item.role not in ("", "user", "assistant"):
            problem = "invalid_value", f"role {item.role[:32]!r} must be user or assistant", "item.role"
        elif item.audio and item.text:
            problem = "invalid_value", "an item carries text or audio, not both", "item.audio"
        elif item.id and item.id in self.ids():
            problem = "invalid_value", f"item id {item.id!r} is already in use", "item.id"
        elif item.audio:
            problem = self._audio_problem(item.audio, role)
        elif not item.text.strip():
            problem = "invalid_value", "the item has no text", "item.text"
        elif len(item.text) > limits.max_text_chars:
            problem = "invalid_value", (f"text has {len(item.text)} characters; the limit is "
                                        f"{limits.max_text_chars}"), "item.text"
        if problem is not None:
            code, message, param = problem
            s.error(code, f"conversation.item.create: {message}", event_id, param)
            return
        if item.id:
            s.client_ids.add(item.id)
        item_id = item.id or s.new_id("item")
        if item.audio:
            self._transcribe(item_id, bytes(item.audio))
        else:
            self.add(Message(role, item.text.strip(), item_id))

    def _create_call_item(self, item: Any, event_id: str) -> None:
        """A function_call_output (the client's result of a call) or a function_call (one the
        client records): each joins the history at once."""
        s, kind = self.session, item.type
        known = s.tools.calls.get(item.call_id)
        problem: tuple[str, str] | None = None  # (message, param)
        extra = [f for f in ("role", "text", "audio") if getattr(item, f)] + \
            [f for f in (("name", "arguments") if kind == "function_call_output" else ("output",)) if getattr(item, f)]
        if extra:
            problem = f"a {kind} item has no {extra[0]}", f"item.{extra[0]}"
        elif not item.call_id:
            problem = f"a {kind} item needs its call_id", "item.call_id"
        elif item.id and item.id in self.ids():
            problem = f"item id {item.id!r} is already in use", "item.id"
        elif kind == "function_call_output" and known is None:
            problem = f"no function call has call_id {item.call_id[:64]!r}", "item.call_id"
        elif kind == "function_call_output" and known is not None and known.answered:
            problem = f"the call {item.call_id[:64]!r} already has its output", "item.call_id"
        elif kind == "function_call_output" and len(item.output) > s.limits.max_tool_output_chars:
            problem = (f"output has {len(item.output)} characters; the limit is {s.limits.max_tool_output_chars}",
                       "item.output")
        elif kind == "function_call" and known is not None:
            problem = f"call_id {item.call_id[:64]!r} is already in use", "item.call_id"
        elif kind == "function_call" and not TOOL_NAME.fullmatch(item.name):
            problem = f"name {item.name[:64]!r} must be 1..64 letters, digits, '_' or '-'", "item.name"
        elif kind == "function_call" and len(item.arguments) > s.limits.max_tool_output_chars:
            problem = (f"arguments has {len(item.arguments)} characters; the limit is "
                       f"{s.limits.max_tool_output_chars}", "item.arguments")
        if problem is not None:
            s.error("invalid_value", f"conversation.item.create: {problem[0]}", event_id, problem[1])
            return
        if item.id:
            s.client_ids.add(item.id)
        item_id = item.id or s.new_id("item")
        if kind == "function_call":
            call = FunctionCall(item.call_id, item.name, item.arguments)
            s.tools.calls[call.call_id] = Call(call, item_id)
            self.add(Message("assistant", "", item_id, call=call))
        else:
            s.tools.answer(item.call_id)
            self.add(Message("tool", item.output, item_id, call_id=item.call_id))
            s.idle.arm()  # no call out any more: the session may be quiet

    def _audio_problem(self, audio: bytes, role: str) -> tuple[str, str, str] | None:
        s = self.session
        settings, width = s.settings, BYTES_PER_SAMPLE[s.settings.input_encoding]
        ms = len(audio) / s.input.bytes_per_ms
        if role != "user":
            return "invalid_value", "an audio item is a user turn (role user)", "item.role"
        if len(audio) % width:
            return "invalid_audio", (f"audio of {len(audio)} bytes is not a whole number of {width}-byte samples "
                                     "of the session's input audio format"), "item.audio"
        if ms > s.limits.max_item_audio_ms:
            return "invalid_value", (f"audio of {ms:.0f} ms is over the {s.limits.max_item_audio_ms} ms limit of "
                                     "an item"), "item.audio"
        if not settings.transcription:
            return "invalid_state", ("input_audio_transcription is off: an audio item is heard through its "
                                     "transcript"), "item.audio"
        return None

    def delete(self, event: Any, event_id: str) -> None:
        s, item_id = self.session, event.item_id
        if (pending := self._pending(item_id)) is not None:
            hint = "cancel it first" if pending.startswith("is a reply") else "delete it once it is transcribed"
            s.error("invalid_state", f"conversation.item.delete: {item_id!r} {pending}; {hint}", event_id, "item_id")
            return
        if (n := self.index(item_id)) is None:
            s.error("item_not_found", f"conversation.item.delete: no item {item_id!r}", event_id, "item_id")
            return
        del self.history[n]
        for response_id, response in list(s.replies.responses.items()):
            if response.item_id == item_id:  # gone for truncate and playback.ack too
                del s.replies.responses[response_id]
        s.send("conversation.item.deleted", item_id=item_id)

    def retrieve(self, event: Any, event_id: str) -> None:
        s, item_id = self.session, event.item_id
        if (pending := self._pending(item_id)) is not None:
            s.error("invalid_state", f"conversation.item.retrieve: {item_id!r} {pending}", event_id, "item_id")
            return
        if (n := self.index(item_id)) is None:
            s.error("item_not_found", f"conversation.item.retrieve: no item {item_id!r}", event_id, "item_id")
            return
        s.send("conversation.item.retrieved", item=item_of(self.history[n]))

    def truncate(self, event: Any, event_id: str) -> None:
        s = self.session
        response = next((r for r in s.replies.responses.values() if r.item_id == event.item_id), None)
        if response is None:
            s.error("item_not_found", f"conversation.item.truncate: no assistant item {event.item_id!r}",
                    event_id, "item_id")
            return
        if response.text_only:
            s.error("invalid_value", f"conversation.item.truncate: {event.item_id!r} is a text-only reply; it has "
                    "no audio to truncate", event_id, "item_id")
            return
        if event.audio_end_ms < 0 or event.audio_end_ms > response.sent_ms:
            s.error("invalid_value", f"conversation.item.truncate: audio_end_ms={event.audio_end_ms} is outside "
                    f"0..{response.sent_ms} (the audio sent for {event.item_id})", event_id, "audio_end_ms")
            return
        response.heard_ms, response.truncated = event.audio_end_ms, True
        response.heard_at = s.clock.now()  # where its playback ended
        if response is s.response and not response.done:  # playback stopped: so does the reply
            s.replies.cancel("client_truncated")
        else:
            s.replies.truncate_history(response)
        s.send("conversation.item.truncated", item_id=event.item_id, content_index=event.content_index,
               audio_end_ms=event.audio_end_ms)
        s.idle.arm()

    # ---- audio items -------------------------------------------------------
    def _transcribe(self, item_id: str, audio: bytes) -> None:
        """The item waits for its transcript like a committed turn (a response.create answers it
        once it is in); decoding and resampling run off the loop."""
        s = self.session
        turn = Turn(item_id, asyncio.get_running_loop().create_future(),
                    audio_ms=round(len(audio) / s.input.bytes_per_ms))
        s.pending_turns.append(turn)
        encoding, rate = s.settings.input_format
        s.spawn(self._feed(turn, audio, encoding, rate), "item-audio")

    async def _feed(self, turn: Turn, audio: bytes, encoding: int, rate: int) -> None:
        async with self._order:
            try:
                pcm = await asyncio.to_thread(recognizer_pcm, audio, encoding, rate)
            except BaseException:
                self.session.transcripts.forget(turn)
                raise
            if self._recognizer is None:
                s = self.session
                self._recognizer = Recognizer(
                    s.access.asr, fast_final=True, priority=Priority.INTERACTIVE,
                    notify=self._recognized, report_faults=True)
                s.track(self._recognizer.start(f"session-{s.id}-item-asr"))
            self._recognizer.language = self.session.settings.language  # the session's, as it is now
            turn.input_offset_ms, turn.asr_offset_ms = 0, self._asr_samples // 16  # word times within the item
            self._asr_samples += len(pcm) // 2
            self._recognizer.send("audio", turn, pcm)
            self._recognizer.send("end", turn)

    def _recognized(self, result: Recognition) -> None:
        """What the audio items' recogniser found: deltas and faults as a turn's, and a transcript,
        which joins the history."""
        s = self.session
        if isinstance(result, Delta):
            s.transcripts.delta(result)
        elif isinstance(result, Fault):
            s.transcripts.failed(result)
        elif isinstance(result, Transcribed):
            self._complete(result.turn)

    def _complete(self, turn: Turn) -> None:
        s = self.session
        s.transcripts.completed(turn)
        self.add(Message("user", turn.said, turn.item_id))
        s.close_if_drained()

    async def close(self) -> None:
        if self._recognizer is not None:
            await self._recognizer.close()
