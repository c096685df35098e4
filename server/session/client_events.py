"""The handlers of a session's client events (docs/protocol.md#client-events): `handle()`
looks each event of a Converse stream up in the table of handlers by its oneof name, and the
handler checks it and answers it (success or error) before the next is handled.

`ClientEvents` is the part of a `Session` (server/session/session.py) that reads what the
client sends. The session holds the state the handlers read and change (config, turn state,
audio input, camera frames, history) and the parts they hand work to (the outbox, the
recogniser feed, the reply pipeline, the conversation items, the idle-turn timer, the tool calls).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rtmedia.protocol.turn_kinds import MANUAL, NONE, SEMANTIC_VAD
from rtmedia.server.session.config import (
    PCM16,
    ConfigError,
    check_max_output_tokens,
    check_output_modality,
)
from rtmedia.v1 import realtime_pb2

if TYPE_CHECKING:
    from rtmedia.server.hearing.recognition import Turn
    from rtmedia.server.session.session import Session

DTMF_KEYS = "0123456789*#ABCD"


class ClientEvents:
    """The client-event handlers of one `Session`: `handlers` is the table from each event's
    oneof name to the method that answers it; the handlers read and change the session's state
    and hand work to its parts."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.settling: asyncio.Task[None] | None = None  # a change the next client event waits for (`settled`)
        self.handlers: dict[str, Callable[[Any, str], None]] = {
            "input_audio_buffer_append": self.on_input_audio_buffer_append,
            "input_audio_buffer_commit": self.on_input_audio_buffer_commit,
            "input_audio_buffer_clear": self.on_input_audio_buffer_clear,
            "input_audio_buffer_dtmf": self.on_input_audio_buffer_dtmf,
            "session_update": self.on_session_update,
            "session_close": self.on_session_close,
            "conversation_item_create": session.items.create,
            "conversation_item_truncate": session.items.truncate,
            "conversation_item_delete": session.items.delete,
            "conversation_item_retrieve": session.items.retrieve,
            "response_create": self.on_response_create,
            "response_cancel": self.on_response_cancel,
            "playback_ack": self.on_playback_ack,
            "camera_frame": self.on_camera_frame,
        }

    def handle(self, request: realtime_pb2.ConverseRequest) -> None:
        """Handle one client event and answer it before the next is handled: the answer (success
        or error) is queued here, not after an await, so that a session's answers follow the order
        of the client events they answer. What waits for the input still queued for the VAD tick
        (a committed turn's audio reaching the recogniser, a response's transcript) goes on after
        the answer. (An audio item's conversation.item.added follows its transcript, as documented.)"""
        s = self.session
        kind = request.WhichOneof("event")
        event_id = request.event_id
        s.last_input = time.monotonic()
        if (problem := self._oversized_id(request, kind)) is not None:
            field, size = problem
            s.error("invalid_value", f"{kind or 'the request'}: {field} is {size} bytes; the limit is "
                    f"{s.limits.max_id_bytes}; the event was dropped",
                    event_id if field != "event_id" else "", field)
            return
        handler = self.handlers.get(kind) if kind is not None else None
        if handler is None:
            s.error("unknown_event", "the request carries no known event (empty oneof or a newer client)",
                    event_id)
            return
        handler(getattr(request, kind), event_id)

    async def settled(self) -> None:
        """Wait for what the last client event started and the next must find in place (a noise
        suppressor being opened: the audio sent after the session.update is heard through it)."""
        if (settling := self.settling) is not None:
            await asyncio.wait([settling])
            if self.settling is settling:
                self.settling = None

    def _oversized_id(self, request: realtime_pb2.ConverseRequest, kind: str | None) -> tuple[str, int] | None:
        """(field, bytes) of an id the server would echo that is over `max_id_bytes`, or None."""
        s = self.session
        limit = s.limits.max_id_bytes
        fields = [("event_id", request.event_id)]
        if kind in ("response_cancel", "playback_ack"):
            fields.append(("response_id", getattr(request, kind).response_id))
        elif kind in ("conversation_item_truncate", "conversation_item_delete", "conversation_item_retrieve"):
            fields.append(("item_id", getattr(request, kind).item_id))
        elif kind == "conversation_item_create":
            fields.append(("item.id", request.conversation_item_create.item.id))
        for field, value in fields:
            if len(value) * 4 > limit and (size := len(value.encode())) > limit:  # a char is 1-4 bytes
                return field, size
        return None

    def on_input_audio_buffer_append(self, event: Any, event_id: str) -> None:
        s = self.session
        data = event.audio
        if s.settings.input_encoding == PCM16 and len(data) % 2:
            s.error("invalid_audio", f"input_audio_buffer.append: {len(data)} bytes is not a whole number of "
                    "PCM16 samples; the chunk was dropped", event_id, "audio")
            return
        s._bytes_in.inc(len(data))
        overflow = s.input.append(data)
        if overflow is None or overflow.chunk_kept:
            chunk_ms = len(data) / s.input.bytes_per_ms
            s.input_ms += chunk_ms
            s._arrivals.append((s.input_ms, s.clock.now()))
            if not s.settings.vad_turns:
                s.buffer_ms += chunk_ms
                s._since_commit_ms += chunk_ms
        if overflow is None:
            return
        s.metrics.input_backpressure.inc()
        if overflow.discarded_ms:  # with VAD: the input stays close to the speaker
            what = "queued audio" if overflow.chunk_kept else "audio (this chunk, over the inbox by itself, included)"
            s.error("input_backpressure", f"the input inbox was full ({s.limits.inbox_ms} ms); "
                    f"{overflow.discarded_ms} ms of {what} were discarded", event_id)
            s.send("input_audio_buffer.cleared", discarded_ms=overflow.discarded_ms, reason="input_backpressure")
        else:  # without VAD: the chunk is refused whole, the buffer keeps everything before it
            queued = round(len(s.input.inbox) / s.input.bytes_per_ms)
            s.error("input_backpressure", f"the input inbox already holds {queued} ms not yet processed (its "
                    f"bound is {s.limits.inbox_ms} ms): this chunk of {round(len(data) / s.input.bytes_per_ms)}"
                    " ms was refused whole and nothing was discarded; send it again", event_id, "audio")

    def on_session_update(self, event: Any, event_id: str) -> None:
        s = self.session
        try:
            new = s.settings.updated(event.session, s.access.tts.rates, s.access.replies.names,
                                        s.limits.max_id_bytes, s.limits.max_instructions_chars,
                                        s.limits.session_caps, s.access.replies.tool_callers,
                                        s.access.asr.languages)
            if new.recording != s.settings.recording:
                new = s.context.recording.checked(new)
        except ConfigError as exc:
            s.error(exc.code, str(exc), event_id, exc.param)
            return
        if new.turn_type == SEMANTIC_VAD and not s.access.turns.available:
            s.error("invalid_value", "turn_detection.type semantic_vad needs an LM to score the user's words, and "
                    "this server runs none (--no-llm without --transformers-model); use server_vad",
                    event_id, "turn_detection.type")
            return
        mid_turn = (s.turn is not None and not s.turn.transcript.done()) or s.buffer_ms > 0 \
            or bool(s._committing)  # a committed turn's audio not yet decoded
        if new.input_format != s.settings.input_format and (mid_turn or s.input.inbox):
            s.error("invalid_state", "input_audio_format cannot change mid-turn; commit or clear the input "
                    "audio buffer first", event_id, "input_audio_format")
            return
        old, s.settings = s.settings, new
        s.recognizer.language = new.language  # from the next turn (or segment) on
        s.input.reconfigure(new, reset=False)
        if old.noise_reduction != new.noise_reduction:
            self.noise_reduction(new.noise_reduction)
        if old.turn_type != new.turn_type or not new.preemptive:
            s.replies.discard_preemptive("session_update")
        if old.turn_type != new.turn_type and s.turn is not None:
            s._end_turn()
        if (old.turn_type, old.idle_timeout_ms) != (new.turn_type, new.idle_timeout_ms):
            s.idle.quiet()  # counts from now
        s.send("session.updated", session=new.to_proto())
        s.idle.arm()

    def noise_reduction(self, kind: str) -> None:
        """The VAD hears the input through a `kind` suppressor from the next tick after it is open
        ("": none); the tick closes the one it replaces. The next client event waits for it
        (`settled`), so every chunk sent after the change goes through the new suppressor."""
        s = self.session
        async def hand_over() -> None:
            stream = await s.access.vad.denoise(kind) if kind else None
            if s.settings.noise_reduction == kind:
                s.input.denoise(stream)
            elif stream is not None:  # changed again meanwhile
                await s.access.vad.close_denoise(stream)

        self.settling = s.spawn(hand_over(), "noise-reduction")

    def on_input_audio_buffer_commit(self, event: Any, event_id: str) -> None:
        s = self.session
        if s.settings.vad_turns:
            s.error("invalid_state", "input_audio_buffer.commit is for manual and none turn detection; "
                    f"{s.settings.turn_type} commits turns itself", event_id)
        elif s.settings.turn_type == MANUAL and s.responding:
            s.error("response_in_progress", "manual mode is half duplex: input is not committed while a "
                    "response plays", event_id)
        elif s._since_commit_ms < 1:  # nothing appended since the last commit (or clear)
            s.error("input_audio_buffer_commit_empty", "the input audio buffer is empty: nothing to commit",
                    event_id)
        else:
            self._commit()

    def _commit(self) -> Turn:
        """The buffered input (manual, none) becomes a turn, committed at once: the buffer's
        length is known now, and input_audio_buffer.committed goes out in the order of the client's
        events. The part of its audio still queued for the VAD tick reaches it there
        (`_committing`), and the recogniser hears the turn's end once all of it has."""
        s = self.session
        turn = s.turn or s._start_turn()
        s.turn = None
        turn.audio_ms = round(s.buffer_ms)
        s.buffer_ms = s._since_commit_ms = 0
        s._committing.append(turn)
        s._committed(turn)
        s.input.after_input(self._commit_delivered)
        return turn

    def _commit_delivered(self) -> None:
        """The oldest committed turn has all its audio: the recogniser hears its end."""
        s = self.session
        s._finish_recognition(s._committing.popleft())

    def on_input_audio_buffer_clear(self, event: Any, event_id: str) -> None:
        # Without VAD the buffer counts all uncommitted audio, the inbox's included; with VAD
        # only the inbox holds input not yet taken.
        s = self.session
        queued = s.input.clear()
        dropped = queued if s.settings.vad_turns else round(s.buffer_ms)
        s.buffer_ms = s._since_commit_ms = 0
        if s.turn is not None:  # the recogniser forgets the uncommitted turn
            s.recognizer.send("abort", s.turn)
            s.turn = None
        s.replies.discard_preemptive("input_cleared")
        s.send("input_audio_buffer.cleared", discarded_ms=dropped, reason="client")

    def on_response_create(self, event: Any, event_id: str) -> None:
        s = self.session
        filler = s.response if s.response is not None and s.response.filler else None
        if filler is not None and filler.audible(s.clock.now()):
            s.replies.cancel("answer_started")  # the answer takes the filler's place, even mid-playback
        if s.responding:
            s.error("response_in_progress", "a response is already in progress; cancel it first", event_id)
            return
        options = {name: getattr(event, name) if event.HasField(name) else None
                   for name in ("instructions", "max_output_tokens", "output_modality", "conversation")}
        instructions, max_tokens = options["instructions"], options["max_output_tokens"]
        if instructions is not None and len(instructions) > s.limits.max_instructions_chars:
            s.error("invalid_value", f"response.create: instructions has {len(instructions)} characters; the "
                    f"limit is {s.limits.max_instructions_chars}", event_id, "instructions")
            return
        try:
            if max_tokens is not None:
                check_max_output_tokens(max_tokens)
            if options["output_modality"] is not None:
                check_output_modality(options["output_modality"])
        except ConfigError as exc:
            s.error("invalid_value", f"response.create: {exc}", event_id, exc.param)
            return
        if options["conversation"] not in (None, "auto", "none"):
            s.error("invalid_value", f"response.create: conversation {options['conversation'][:32]!r} must be "
                    "\"auto\" or \"none\"", event_id, "conversation")
            return
        start = {"modality": options["output_modality"], "joins_history": options["conversation"] != "none"}
        # none mode responds to the buffered audio, committing it (not for an out-of-band
        # response). The response starts now, answered by response.created; it waits for its
        # turn's transcript, which comes once the turn's audio has gone through the VAD tick.
        commit = s.settings.turn_type == NONE and start["joins_history"] and \
            (s.buffer_ms >= 1 or bool(s.input.inbox))
        self._respond_to(self._commit() if commit else None, instructions, max_tokens, event_id, start)

    def _respond_to(self, turn: Turn | None, instructions: str | None, max_tokens: int | None,
                    event_id: str, start: dict[str, Any]) -> None:
        s = self.session
        turn = turn or (s.pending_turns[-1] if s.pending_turns else None)
        if turn is None and not any(m.text or m.call for m in s.history):
            s.error("invalid_state", "response.create: there is nothing to respond to (no audio, turn or text)",
                    event_id)
            return
        s.idle.cancel()
        if start["joins_history"]:
            s.tools.stop()  # the answer to the calls, or the user moved on: the wait ends
        s.replies.start(turn, instructions, max_tokens, **start, request_event_id=event_id)

    def on_response_cancel(self, event: Any, event_id: str) -> None:
        s = self.session
        response = s.response
        if response is None or response.done or (event.response_id and event.response_id != response.response_id):
            s.error("response_not_found", f"response.cancel: no response {event.response_id or ''} in progress"
                    .replace("  ", " "), event_id, "response_id")
            return
        s.replies.cancel("client_cancelled")

    def on_input_audio_buffer_dtmf(self, event: Any, event_id: str) -> None:
        """A key the caller pressed (a telephony door): told back as OpenAI's SIP event."""
        s = self.session
        if len(event.event) != 1 or event.event not in DTMF_KEYS:
            s.error("invalid_value", f"input_audio_buffer.dtmf: event is a keypad key, one of 0-9, *, #, A-D; "
                    f"got {event.event[:16]!r}", event_id, "event")
            return
        s.send("input_audio_buffer.dtmf_event_received", event=event.event, received_at=int(time.time()))

    def on_playback_ack(self, event: Any, event_id: str) -> None:
        s = self.session
        response = s.replies.responses.get(event.response_id)
        if response is None:
            s.error("response_not_found", f"playback.ack: unknown response {event.response_id!r}", event_id,
                    "response_id")
            return
        if event.played_ms < 0 or event.played_ms > response.sent_ms:
            s.error("invalid_value", f"playback.ack: played_ms={event.played_ms} is outside 0..{response.sent_ms}",
                    event_id, "played_ms")
            return
        response.heard_ms, response.heard_at = event.played_ms, s.clock.now()
        s.send("playback.acknowledged", response_id=response.response_id, played_ms=event.played_ms)
        if response is s.response:
            s.idle.arm()

    def on_camera_frame(self, event: Any, event_id: str) -> None:
        s = self.session
        image = event.image
        if len(image) > s.limits.max_camera_frame_bytes:
            s.error("invalid_value", f"camera.frame: {len(image)} bytes is over the "
                    f"{s.limits.max_camera_frame_bytes}-byte limit; the frame was dropped", event_id, "image")
        elif not (image.startswith(b"\xff\xd8\xff") or image.startswith(b"\x89PNG\r\n\x1a\n")):
            s.error("invalid_value", "camera.frame: the image is neither JPEG nor PNG; the frame was dropped",
                    event_id, "image")
        else:
            s.camera.append(image)
            while len(s.camera) > s.limits.max_camera_frames or \
                    sum(map(len, s.camera)) > s.limits.max_camera_total_bytes:
                s.camera.popleft()  # the oldest is retired first

    def on_session_close(self, event: Any, event_id: str) -> None:
        s = self.session
        s.finish("client")
