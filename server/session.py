"""A duplex speech session: one Converse stream (SPEC §1).

The session owns its config, turn state, audio input, outbound events, the
conversation history and the ids of its in-flight work. It never calls an
engine: audio goes through the VAD tick lane (server/audio_input.py), ASR and
TTS work through the scheduler's lanes.

Tasks, each owned here and cancelled by `close()`:
- the ASR feeder: sends turn audio to the recogniser in order and turns its
  results into transcription events (a server_vad turn's utterance ends at each
  pause, so its final is ready when speech_stopped comes: Limits.early_finals);
- the response task: transcript -> responder -> TTS -> audio deltas.

Every response has an epoch. Cancelling a response (barge-in,
response.cancel) bumps the epoch, and the outbox drops media events of an
older epoch, so a late result of a cancelled response is never sent. Control
events (barge-in, errors, lifecycle) overtake queued media.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rtmedia.engines.asr import AsrEvent, AsrItem, asr_lane
from rtmedia.engines.responder import Message, ReplyRequest
from rtmedia.engines.tts import TextChunker, TtsItem
from rtmedia.protocol.events import server_event
from rtmedia.server.audio_input import Action, AudioInput
from rtmedia.server.scheduler import Priority
from rtmedia.server.session_config import PCM16, ConfigError, SessionSettings
from rtmedia.v1 import realtime_pb2

log = logging.getLogger(__name__)
ACK_FRESH_S = 1.0  # an ack older than this no longer tells where playback is
# A long sentence is decoded in windows from this many latent frames (~0.56 s of audio at
# 22.05 kHz), doubling: its first audio comes after a quarter of its decode or less.
TTS_WINDOW_FRAMES = 48
TTS_DUE_MARGIN_S = 0.3  # a later TTS item is due this long before the audio before it runs out
PLAYED_TOLERANCE_MS = 40


@dataclass
class Limits:
    inbox_ms: int = 2000
    max_camera_frames: int = 8
    max_camera_frame_bytes: int = 2 * 1024 * 1024
    max_camera_total_bytes: int = 4 * 1024 * 1024
    max_text_chars: int = 5000
    max_outbox_events: int = 4096
    transcript_wait_s: float = 20.0  # a late reply beats a failed one under overload
    # At a pause in a server_vad turn (160 ms of silence, SPEC 1.3's silence_duration_ms not
    # yet reached) the recogniser finishes the turn's audio so far, so the final is ready by
    # speech_stopped; speech that resumes starts a new segment, and the turn's transcript joins
    # the segments' finals.
    early_finals: bool = True
    # Reply audio goes out in deltas of this length, at most output_lead_ms ahead of
    # the client's playback (acked position, or wall clock since the first delta).
    output_delta_ms: int = 200
    output_lead_ms: int = 1000

    def to_proto(self, max_sessions: int, lm_slots: int) -> realtime_pb2.SessionLimits:
        return realtime_pb2.SessionLimits(
            inbox_ms=self.inbox_ms, max_camera_frames=self.max_camera_frames,
            max_camera_frame_bytes=self.max_camera_frame_bytes, max_camera_total_bytes=self.max_camera_total_bytes,
            max_text_chars=self.max_text_chars, max_sessions=max_sessions, lm_slots=lm_slots,
        )


@dataclass
class Turn:
    """A user turn: audio committed to the recogniser, and its transcript."""

    item_id: str
    transcript: asyncio.Future[str]
    stopped_at: float = 0.0  # perf_counter of speech_stopped / commit
    audio_ms: int = 0
    partial: str = ""  # the transcription deltas sent so far, concatenated
    # Where the turn's audio starts in the session input and in the recogniser's
    # stream (which joins every turn's audio): word timings are shifted by the difference.
    input_offset_ms: int | None = None
    asr_offset_ms: int = 0
    # The recogniser's finals of the turn's segments: one, unless the turn was cut at pauses
    # (Limits.early_finals); and whether a segment has audio sent and no end yet.
    segments: list[AsrEvent] = field(default_factory=list)
    segment_open: bool = False

    @property
    def said(self) -> str:
        """The text of the segments' finals so far."""
        return " ".join(event.text for event in self.segments if event.text)


@dataclass
class Response:
    response_id: str
    item_id: str
    epoch: int
    task: asyncio.Task[None] | None = None
    clauses: list[tuple[str, int, int]] = field(default_factory=list)  # (text, start_ms, end_ms) sent
    sent_samples: int = 0
    sent_ms: int = 0
    first_audio_at: float = 0.0
    heard_ms: int | None = None  # from playback.ack / conversation.item.truncate
    heard_at: float = 0.0  # when the last ack arrived
    truncated: bool = False  # the client said playback stopped
    done: bool = False
    history_index: int = -1  # its assistant message in the history

    def played_ms(self, now: float) -> int:
        """Where the client's playback is: its ack while fresh (under ACK_FRESH_S old),
        else the wall time since the first audio was sent; at most what was sent."""
        if self.heard_ms is not None and (self.truncated or now - self.heard_at < ACK_FRESH_S):
            return min(self.heard_ms, self.sent_ms)
        if not self.first_audio_at:
            return 0
        return int(min(self.sent_ms, (now - self.first_audio_at) * 1000))

    def audible(self, now: float) -> bool:
        """Generating, or still playing at the client (within a rounding tolerance)."""
        return not self.done or (not self.truncated and self.played_ms(now) < self.sent_ms - PLAYED_TOLERANCE_MS)

    def heard_text(self) -> str:
        """The reply as far as it was heard: whole clauses, then the played fraction
        of the current clause cut at a word boundary. Without acks, what was sent."""
        heard = self.sent_ms if self.heard_ms is None else min(self.heard_ms, self.sent_ms)
        words: list[str] = []
        for text, start, end in self.clauses:
            if end <= heard:
                words += text.split()
            elif start < heard:
                clause = text.split()
                words += clause[: int(len(clause) * (heard - start) / (end - start))]
        return " ".join(words)


class Outbox:
    """Outbound events: control first, then media of the current epoch, in order."""

    def __init__(self, limit: int) -> None:
        self._control: deque[realtime_pb2.ConverseResponse] = deque()
        self._media: deque[tuple[int, realtime_pb2.ConverseResponse]] = deque()
        self._ready = asyncio.Event()
        self._limit = limit
        self.closed = False
        self._last: realtime_pb2.ConverseResponse | None = None

    def control(self, event: realtime_pb2.ConverseResponse) -> None:
        self._control.append(event)
        self._ready.set()

    def media(self, epoch: int, event: realtime_pb2.ConverseResponse) -> None:
        if len(self._media) >= self._limit:
            raise OverflowError(f"the client is not reading: {len(self._media)} events are waiting")
        self._media.append((epoch, event))
        self._ready.set()

    def close(self, last: realtime_pb2.ConverseResponse | None = None) -> None:
        """No more events but `last`, which goes out after everything queued."""
        if not self.closed:
            self.closed, self._last = True, last
        self._ready.set()

    async def get(self, epoch: int) -> realtime_pb2.ConverseResponse | None:
        """The next event to write, or None once closed and empty."""
        while True:
            if self._control:
                return self._control.popleft()
            while self._media:
                event_epoch, event = self._media.popleft()
                if event_epoch == epoch:
                    return event
            if self.closed:
                last, self._last = self._last, None
                return last
            self._ready.clear()
            await self._ready.wait()


class Session:
    """One Converse stream. `handle()` takes client events; the service's writer
    loop writes what `outbox.get()` returns."""

    def __init__(self, session_id: str, services: Any, settings: SessionSettings) -> None:
        self.id = session_id
        self.services = services  # RealtimeService: scheduler, engines, metrics, limits
        self.settings = settings
        self.limits: Limits = services.limits
        self.outbox = Outbox(self.limits.max_outbox_events)
        self.epoch = 0
        self.started = time.monotonic()
        self.last_input = self.started
        self.closing_reason: str | None = None
        self._ids = itertools.count(1)
        self.history: list[Message] = []
        self.responses: dict[str, Response] = {}
        self.response: Response | None = None  # the latest response
        self.turn: Turn | None = None  # the turn being spoken or committed
        self.pending_turns: deque[Turn] = deque()  # turns sent to the recogniser, oldest first
        self.buffer_ms = 0.0  # uncommitted input audio (manual / none)
        self.speech_start_ms = 0
        self.response_requested = False  # a response.create waits behind queued input
        self._asr_samples = 0  # 16 kHz samples sent to the recogniser
        self.camera: deque[bytes] = deque()
        self._asr_queue: deque[tuple[str, Turn, bytes]] = deque()
        self._asr_ready = asyncio.Event()
        self._asr_stream: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        vad = services.vad.open_stream()
        self.input = AudioInput(settings, self.limits.inbox_ms, self.on_audio, vad)
        services.vad_tick.inputs.add(self.input)
        self._spawn(self._asr_feeder(), "asr")

    # ---- helpers ---------------------------------------------------------
    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{self.id[-6:]}_{next(self._ids)}"

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"session-{self.id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("session task failed", exc_info=task.exception(), extra={"session_id": self.id})
            self.error("server_error", f"internal error in {task.get_name()}: {task.exception()}")

    def send(self, name: str, **fields: Any) -> None:
        self.outbox.control(server_event(name, **fields))

    def send_media(self, response: Response, name: str, **fields: Any) -> None:
        self.outbox.media(response.epoch, server_event(name, **fields))

    def error(self, code: str, message: str, event_id: str = "", param: str = "") -> None:
        self.outbox.control(server_event("error", code=code, message=message, event_id=event_id, param=param))

    def created_event(self) -> realtime_pb2.ConverseResponse:
        limits = self.limits.to_proto(self.services.max_sessions, self.services.lm_slots)
        return server_event("session.created", session_id=self.id, session=self.settings.to_proto(), limits=limits)

    @property
    def responding(self) -> bool:
        return self.response_requested or (self.response is not None and not self.response.done)

    # ---- client events ---------------------------------------------------
    def handle(self, request: realtime_pb2.ConverseRequest) -> None:
        kind = request.WhichOneof("event")
        event_id = request.event_id
        self.last_input = time.monotonic()
        handler = getattr(self, f"on_{kind}", None)
        if handler is None:
            self.error("unknown_event", "the request carries no known event (empty oneof or a newer client)",
                       event_id)
            return
        handler(getattr(request, kind), event_id)

    def on_input_audio_buffer_append(self, event: Any, event_id: str) -> None:
        data = event.audio
        if self.settings.input_encoding == PCM16 and len(data) % 2:
            self.error("invalid_audio", f"input_audio_buffer.append: {len(data)} bytes is not a whole number of "
                       "PCM16 samples; the chunk was dropped", event_id, "audio")
            return
        self.services.bytes_in.inc(len(data))
        discarded = self.input.append(data)
        if self.settings.turn_type != "server_vad":
            self.buffer_ms += len(data) / self.input.bytes_per_ms
        if discarded:
            self.services.metrics.input_backpressure.inc()
            self.error("input_backpressure", f"the input inbox was full ({self.limits.inbox_ms} ms); "
                       f"{discarded} ms of queued audio were discarded", event_id)
            self.send("input_audio_buffer.cleared", discarded_ms=discarded, reason="input_backpressure")

    def on_session_update(self, event: Any, event_id: str) -> None:
        try:
            new = self.settings.updated(event.session, self.services.voices, self.services.responders)
        except ConfigError as exc:
            self.error("invalid_value", str(exc), event_id, exc.param)
            return
        mid_turn = (self.turn is not None and not self.turn.transcript.done()) or self.buffer_ms > 0
        if new.input_format != self.settings.input_format and (mid_turn or self.input.inbox):
            self.error("invalid_state", "input_audio_format cannot change mid-turn; commit or clear the input "
                       "audio buffer first", event_id, "input_audio_format")
            return
        old, self.settings = self.settings, new
        self.input.reconfigure(new, reset=False)
        if old.turn_type != new.turn_type and self.turn is not None:
            self._end_turn()
        self.send("session.updated", session=new.to_proto())

    def on_input_audio_buffer_commit(self, event: Any, event_id: str) -> None:
        if self.settings.turn_type == "server_vad":
            self.error("invalid_state", "input_audio_buffer.commit is for manual and none turn detection; "
                       "server_vad commits turns itself", event_id)
        elif self.settings.turn_type == "manual" and self.responding:
            self.error("response_in_progress", "manual mode is half duplex: input is not committed while a "
                       "response plays", event_id)
        elif self.buffer_ms < 1 and not self.input.inbox:
            self.error("input_audio_buffer_commit_empty", "the input audio buffer is empty: nothing to commit",
                       event_id)
        else:  # behind the audio still queued for the VAD tick
            self.input.after_input(self._commit)

    def _commit(self) -> Turn:
        turn = self.turn or self._start_turn()
        turn.audio_ms = round(self.buffer_ms)
        self.buffer_ms = 0
        self._end_turn()
        return turn

    def on_input_audio_buffer_clear(self, event: Any, event_id: str) -> None:
        dropped = self.input.clear() + round(self.buffer_ms)
        self.buffer_ms = 0
        if self.turn is not None:  # the recogniser forgets the uncommitted turn
            self._to_asr("abort", self.turn)
            self.turn = None
        self.send("input_audio_buffer.cleared", discarded_ms=dropped, reason="client")

    def on_conversation_item_create(self, event: Any, event_id: str) -> None:
        item = event.item
        if item.role not in ("", "user", "assistant"):
            self.error("invalid_value", f"conversation.item.create: role {item.role!r} must be user or assistant",
                       event_id, "item.role")
        elif not item.text.strip():
            self.error("invalid_value", "conversation.item.create: the item has no text", event_id, "item.text")
        elif len(item.text) > self.limits.max_text_chars:
            self.error("invalid_value", f"conversation.item.create: text has {len(item.text)} characters; the "
                       f"limit is {self.limits.max_text_chars}", event_id, "item.text")
        else:
            self.history.append(Message(item.role or "user", item.text.strip()))

    def on_conversation_item_truncate(self, event: Any, event_id: str) -> None:
        response = next((r for r in self.responses.values() if r.item_id == event.item_id), None)
        if response is None:
            self.error("item_not_found", f"conversation.item.truncate: no assistant item {event.item_id!r}",
                       event_id, "item_id")
            return
        if event.audio_end_ms < 0 or event.audio_end_ms > response.sent_ms:
            self.error("invalid_value", f"conversation.item.truncate: audio_end_ms={event.audio_end_ms} is outside "
                       f"0..{response.sent_ms} (the audio sent for {event.item_id})", event_id, "audio_end_ms")
            return
        response.heard_ms, response.truncated = event.audio_end_ms, True
        self._truncate_history(response)

    def on_response_create(self, event: Any, event_id: str) -> None:
        if self.responding:
            self.error("response_in_progress", "a response is already in progress; cancel it first", event_id)
            return
        instructions = event.instructions if event.HasField("instructions") else None
        max_tokens = event.max_output_tokens if event.HasField("max_output_tokens") else None
        # none mode responds to the buffered audio (committing it); a commit still
        # queued behind input goes first. Either way the response waits its turn.
        commit = self.settings.turn_type == "none" and (self.buffer_ms >= 1 or bool(self.input.inbox))
        if commit or self.input.segments:
            self.response_requested = True

            def respond_after_input() -> None:
                self.response_requested = False
                self._respond_to(self._commit() if commit else None, instructions, max_tokens, event_id)

            self.input.after_input(respond_after_input)
        else:
            self._respond_to(None, instructions, max_tokens, event_id)

    def _respond_to(self, turn: Turn | None, instructions: str | None, max_tokens: int | None,
                    event_id: str) -> None:
        turn = turn or (self.pending_turns[-1] if self.pending_turns else None)
        if turn is None and not self.history:
            self.error("invalid_state", "response.create: there is nothing to respond to (no audio, turn or text)",
                       event_id)
            return
        self._start_response(turn, instructions, max_tokens)

    def on_response_cancel(self, event: Any, event_id: str) -> None:
        response = self.response
        if response is None or response.done or (event.response_id and event.response_id != response.response_id):
            self.error("response_not_found", f"response.cancel: no response {event.response_id or ''} in progress"
                       .replace("  ", " "), event_id, "response_id")
            return
        self.cancel_response("client_cancelled")

    def on_playback_ack(self, event: Any, event_id: str) -> None:
        response = self.responses.get(event.response_id)
        if response is None:
            self.error("response_not_found", f"playback.ack: unknown response {event.response_id!r}", event_id,
                       "response_id")
            return
        if event.played_ms < 0 or event.played_ms > response.sent_ms:
            self.error("invalid_value", f"playback.ack: played_ms={event.played_ms} is outside 0..{response.sent_ms}",
                       event_id, "played_ms")
            return
        response.heard_ms, response.heard_at = event.played_ms, time.perf_counter()
        self.send("playback.acknowledged", response_id=response.response_id, played_ms=event.played_ms)

    def on_camera_frame(self, event: Any, event_id: str) -> None:
        image = event.image
        if len(image) > self.limits.max_camera_frame_bytes:
            self.error("invalid_value", f"camera.frame: {len(image)} bytes is over the "
                       f"{self.limits.max_camera_frame_bytes}-byte limit; the frame was dropped", event_id, "image")
        elif not (image.startswith(b"\xff\xd8\xff") or image.startswith(b"\x89PNG\r\n\x1a\n")):
            self.error("invalid_value", "camera.frame: the image is neither JPEG nor PNG; the frame was dropped",
                       event_id, "image")
        else:
            self.camera.append(image)
            while len(self.camera) > self.limits.max_camera_frames or \
                    sum(map(len, self.camera)) > self.limits.max_camera_total_bytes:
                self.camera.popleft()  # the oldest is retired first

    def on_session_close(self, event: Any, event_id: str) -> None:
        self.finish("client")

    # ---- audio results from the VAD tick ----------------------------------
    def on_audio(self, actions: list[Action]) -> None:
        for kind, value in actions:
            if kind == "started":
                self._on_speech_started(value)
            elif kind == "audio":
                if self.settings.transcription:
                    offset_ms, pcm = value
                    turn = self.turn or self._start_turn()
                    if turn.input_offset_ms is None:
                        turn.input_offset_ms, turn.asr_offset_ms = offset_ms, self._asr_samples // 16
                    self._asr_samples += len(pcm) // 2
                    self._to_asr("audio", turn, pcm)
            elif kind == "pause":
                if self.turn is not None and self.limits.early_finals:
                    self._to_asr("cut", self.turn)
            elif kind == "stopped":
                self._on_speech_stopped(value)
            elif kind == "marker":
                value()

    def _to_asr(self, kind: str, turn: Turn, audio: bytes = b"") -> None:
        self._asr_queue.append((kind, turn, audio))
        self._asr_ready.set()

    def _start_turn(self) -> Turn:
        self.turn = Turn(self.new_id("item"), asyncio.get_running_loop().create_future())
        return self.turn

    def _end_turn(self) -> None:
        turn, self.turn = self.turn, None
        if turn is None:
            return
        turn.stopped_at = time.perf_counter()
        self.pending_turns.append(turn)
        self.send("input_audio_buffer.committed", item_id=turn.item_id, audio_ms=turn.audio_ms)
        if self.settings.transcription:
            self._to_asr("end", turn)
        else:
            turn.transcript.set_result("")

    def _on_speech_started(self, start_ms: int) -> None:
        turn = self._start_turn()
        self.send("input_audio_buffer.speech_started", item_id=turn.item_id, audio_start_ms=start_ms)
        self.speech_start_ms = start_ms
        if self.settings.interrupt_response and self.response is not None \
                and self.response.audible(time.perf_counter()):
            started = self.input.collected_at
            self.cancel_response("turn_detected")
            self.services.metrics.barge_in.observe(time.perf_counter() - started)
        prepare = getattr(self.services.responders.get(self.settings.responder), "prepare", None)
        if prepare is not None and self.settings.create_response:  # the reply's prompt, up to the user's words
            self._spawn(prepare(self._reply_request()), "prepare")

    def _reply_request(self, instructions: str | None = None, max_tokens: int | None = None,
                       on_wait: Callable[[int], None] | None = None,
                       pause: Callable[[], bool] | None = None) -> ReplyRequest:
        settings = self.settings
        return ReplyRequest(
            history=list(self.history),
            instructions=settings.instructions if instructions is None else instructions,
            max_output_tokens=settings.max_output_tokens if max_tokens is None else max_tokens,
            images=list(self.camera),
            on_wait=on_wait,
            conversation=self.id,
            pause=pause,
        )

    def _on_speech_stopped(self, end_ms: int) -> None:
        turn = self.turn or self._start_turn()
        self.send("input_audio_buffer.speech_stopped", item_id=turn.item_id, audio_end_ms=end_ms)
        turn.audio_ms = end_ms - max(0, self.speech_start_ms - self.settings.prefix_padding_ms)
        self._end_turn()
        if self.settings.create_response and self.closing_reason is None:
            if self.responding:  # interrupt_response off: the new turn waits its turn
                self.error("response_in_progress", "a turn ended while a response is in progress; "
                           "it is in the history but gets no response of its own")
                return
            self._start_response(turn)

    # ---- recognition -------------------------------------------------------
    async def _asr_feeder(self) -> None:
        """Sends turn audio to the recogniser in order, one utterance per segment of a turn.
        Queue entries are ("audio", turn, pcm), ("cut", turn) (a pause: end the segment),
        ("end", turn) or ("abort", turn)."""
        queue = self._asr_queue
        while True:
            while not queue:
                self._asr_ready.clear()
                await self._asr_ready.wait()
            kind, turn, audio = queue.popleft()
            while kind == "audio" and queue and queue[0][1] is turn:  # coalesce the turn's audio
                kind, _, more = queue.popleft()
                audio += more
            if audio or turn.segment_open:  # else nothing to send: a pause cut the segment already
                if self._asr_stream is None:
                    self._asr_stream = self.services.asr.open_stream(segment=False, fast_final=True)
                item = AsrItem(self._asr_stream, audio, end=kind != "audio")
                turn.segment_open = kind == "audio"
                events = await self.services.scheduler.submit(asr_lane(item), item, Priority.REALTIME)
                if kind == "abort":  # an aborted (cleared) turn's transcript is dropped
                    continue
                for event in events:
                    self._on_transcript(event, turn)
            if kind == "end":
                self._complete(turn)

    def _on_transcript(self, event: AsrEvent, turn: Turn) -> None:
        """A partial becomes a delta; a segment's final is kept for the turn's transcript, and
        the words it adds to the deltas sent so far go out as one more delta."""
        if event.is_final:
            turn.segments.append(event)
            said = turn.said
            if not said.startswith(turn.partial) or said[len(turn.partial):][:1] not in ("", " "):
                return  # the final revised words already sent as deltas: the transcript decides
            added = said[len(turn.partial):].strip()
        else:
            added = event.delta
        if added:  # deltas concatenate into the text: words after the first get their space
            delta = f" {added}" if turn.partial else added
            turn.partial += delta
            self.send("conversation.item.input_audio_transcription.delta", item_id=turn.item_id, delta=delta)

    def _complete(self, turn: Turn) -> None:
        """The turn's transcript: its segments' finals joined."""
        text = turn.said
        shift = (turn.input_offset_ms or 0) - turn.asr_offset_ms  # recogniser stream -> session input
        words = [{"word": w, "start_ms": s + shift, "end_ms": e + shift, "confidence": c}
                 for event in turn.segments for w, s, e, c in event.words]
        self.send("conversation.item.input_audio_transcription.completed", item_id=turn.item_id,
                  transcript=text, words=words)
        if turn in self.pending_turns:
            self.pending_turns.remove(turn)
        if text:
            self.history.append(Message("user", text))
        if not turn.transcript.done():
            turn.transcript.set_result(text)

    # ---- responses -----------------------------------------------------------
    def _start_response(self, turn: Turn | None, instructions: str | None = None,
                        max_tokens: int | None = None) -> None:
        response = Response(self.new_id("resp"), self.new_id("item"), self.epoch)
        self.responses[response.response_id] = response
        self.response = response
        self.send("response.created", response_id=response.response_id, item_id=response.item_id)
        response.task = self._spawn(self._respond(response, turn, instructions, max_tokens), "response")

    async def _respond(self, response: Response, turn: Turn | None, instructions: str | None,
                       max_tokens: int | None) -> None:
        """Transcript -> responder text -> TTS clause by clause -> audio deltas. A clause's audio
        is sent as soon as it is synthesised (a long sentence's window by window), while the
        responder produces the next text; the stream's items are synthesised in order, one at a
        time, and other sessions' items run between the windows of a long sentence."""
        services, settings = self.services, self.settings
        status, reason, text = "completed", "", ""
        spoken: list[asyncio.Future[bytes]] = []
        texts: asyncio.Queue[tuple[str, bool] | None] = asyncio.Queue()  # chunks to speak, and whether final
        sending: asyncio.Queue[tuple[str, asyncio.Future[bytes]] | None] = asyncio.Queue()
        sender: asyncio.Future[None] | None = None
        synthesizer: asyncio.Future[None] | None = None
        try:
            if turn is not None:
                await asyncio.wait_for(asyncio.shield(turn.transcript), self.limits.transcript_wait_s)
            request = self._reply_request(
                instructions, max_tokens,
                on_wait=lambda position: self.send_media(response, "response.waiting",
                                                         response_id=response.response_id, reason="lm_slot",
                                                         queue_position=position),
                # The LM waits while the first clause, which the user is waiting for, is synthesised.
                pause=lambda: bool(spoken) and not spoken[0].done(),
            )
            tts = services.tts.open_stream(settings.voice, settings.output_rate, window_frames=TTS_WINDOW_FRAMES)

            async def send_all() -> None:
                while (item := await sending.get()) is not None:
                    said, audio = item
                    await self._send_audio(response, said, await audio, tts.output_rate, turn)

            async def synthesize_all() -> None:
                """The stream's items one at a time, in order (the stream is stateful): each chunk,
                then, while the stream has more, the later windows of its long sentences. The first
                item is due at once (the user is waiting); each later one when the audio before it
                would run out at the client, less TTS_DUE_MARGIN_S (the lane runs the item due
                soonest, so a session about to run dry goes before one with audio to spare)."""
                loop = asyncio.get_running_loop()
                playing_from, audio_s = None, 0.0  # when the first audio was ready; audio so far
                while (chunk := await texts.get()) is not None:
                    text, final = chunk
                    while True:
                        due = None if playing_from is None else playing_from + audio_s - TTS_DUE_MARGIN_S
                        spoken.append(asyncio.ensure_future(services.scheduler.submit(
                            "tts", TtsItem(tts, text, final=final), Priority.REALTIME, due)))
                        sending.put_nowait((text, spoken[-1]))
                        await asyncio.wait([spoken[-1]])
                        if spoken[-1].cancelled() or spoken[-1].exception() is not None:
                            sending.put_nowait(None)  # the sender stops at the failed item
                            return
                        audio_s += len(spoken[-1].result()) / 2 / tts.output_rate
                        if playing_from is None and audio_s:
                            playing_from = loop.time()
                        if not tts.pending:
                            break
                        text = ""
                sending.put_nowait(None)

            sender = asyncio.ensure_future(send_all())
            synthesizer = asyncio.ensure_future(synthesize_all())

            async def speak(chunks: list[str], final: bool = False) -> None:
                for chunk in chunks:
                    if spoken:  # the responder waits for the TTS item submitted last (the LM's pacing)
                        await asyncio.wait([spoken[-1]])
                    if sender.done():
                        sender.result()  # sending failed: raise it here
                    texts.put_nowait((chunk, False))
                if final:
                    texts.put_nowait(("", True))  # flushes the resampler's tail
                    texts.put_nowait(None)

            chunker = TextChunker()
            async for delta in services.responders[settings.responder].reply(request):
                text += delta
                self.send_media(response, "response.output_text.delta", response_id=response.response_id,
                                item_id=response.item_id, delta=delta)
                await speak(chunker.feed(delta))
            await speak(chunker.flush(), final=True)
            await synthesizer
            await sender
        except TimeoutError:
            status, reason = "failed", "the transcript of the turn did not arrive in time"
        except Exception as exc:
            log.exception("response failed", extra={"session_id": self.id})
            status, reason = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            for task in [*spoken, *(t for t in (sender, synthesizer) if t is not None)]:
                task.cancel()
        self._finish_response(response, text, status, reason)

    async def _send_audio(self, response: Response, clause: str, audio: bytes, rate: int,
                          turn: Turn | None) -> None:
        """Send one clause's audio as paced deltas and record where the clause lies."""
        start_ms = response.sent_ms
        step = rate * self.limits.output_delta_ms // 1000 * 2
        for offset in range(0, len(audio), step):
            piece = audio[offset:offset + step]
            lead = response.sent_ms - response.played_ms(time.perf_counter())
            if lead > self.limits.output_lead_ms:
                await asyncio.sleep((lead - self.limits.output_lead_ms) / 1000)
            if not response.first_audio_at:
                response.first_audio_at = time.perf_counter()
                if turn is not None and turn.stopped_at:
                    self._observe_latency(response.first_audio_at - turn.stopped_at)
            response.sent_samples += len(piece) // 2
            response.sent_ms = response.sent_samples * 1000 // rate
            self.services.metrics.bytes_total.labels("out").inc(len(piece))
            self.send_media(response, "response.output_audio.delta", response_id=response.response_id,
                            item_id=response.item_id, audio=piece, sample_rate=rate, channels=1)
        if clause and audio:
            response.clauses.append((clause, start_ms, response.sent_ms))
        elif audio and response.clauses and response.clauses[-1][2] == start_ms:  # its sentence's later window
            response.clauses[-1] = (*response.clauses[-1][:2], response.sent_ms)

    def _observe_latency(self, latency: float) -> None:
        self.services.metrics.response_latency.observe(latency)
        if self.settings.turn_type == "server_vad":
            self.services.metrics.voice_to_voice.observe(latency + self.settings.silence_duration_ms / 1000)

    def _finish_response(self, response: Response, text: str, status: str, reason: str) -> None:
        response.done = True
        rid, item = response.response_id, response.item_id
        if text:
            self.history.append(Message("assistant", text))
            response.history_index = len(self.history) - 1
        if status == "completed":
            self.send_media(response, "response.output_text.done", response_id=rid, item_id=item, text=text)
            self.send_media(response, "response.output_audio.done", response_id=rid, item_id=item)
        usage = {"output_tokens": len(text.split()), "output_audio_ms": response.sent_ms}
        self.send_media(response, "response.done", response_id=rid, status=status, status_reason=reason,
                        usage=usage)
        if self.closing_reason is not None:  # draining: the response was allowed to finish
            self.outbox.close(server_event("session.closed", reason=self.closing_reason))

    def cancel_response(self, reason: str) -> None:
        """Barge-in or response.cancel: stop generation, fence off its epoch, tell the client."""
        response = self.response
        if response is None:
            return
        was_generating = not response.done
        self.epoch += 1
        if response.task is not None:
            response.task.cancel()
        self.send("output_audio_buffer.cleared", response_id=response.response_id, audio_end_ms=response.sent_ms)
        if was_generating:
            response.done = True
            self.send("response.done", response_id=response.response_id, status="cancelled", status_reason=reason,
                      usage={"output_audio_ms": response.sent_ms})
            text = response.heard_text()
            if text:
                self.history.append(Message("assistant", text))
                response.history_index = len(self.history) - 1
        else:
            self._truncate_history(response)

    def _truncate_history(self, response: Response) -> None:
        if 0 <= response.history_index < len(self.history):
            self.history[response.history_index] = Message("assistant", response.heard_text())

    # ---- lifecycle ---------------------------------------------------------------
    def finish(self, reason: str) -> None:
        """Close the session with session.closed{reason}; a response in flight is cancelled
        unless the server is draining (then it completes first)."""
        if self.closing_reason is not None:
            return
        self.closing_reason = reason
        if self.responding and reason == "server_shutdown":
            return  # _finish_response closes the outbox after the response
        if self.responding:
            self.cancel_response(reason)
        self.outbox.close(server_event("session.closed", reason=reason))

    def shutdown_now(self) -> None:
        """The drain grace period ended: close even if a response is still running."""
        if self.responding:
            self.cancel_response("server_shutdown")
        self.outbox.close(server_event("session.closed", reason="server_shutdown"))

    async def close(self) -> None:
        """Free every resource of the session: tasks, VAD row, recogniser state."""
        self.services.vad_tick.inputs.discard(self.input)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
        if self._asr_stream is not None:
            await asyncio.to_thread(self.services.asr.close_stream, self._asr_stream)
            self._asr_stream: Any = None
        for turn in [self.turn, *self.pending_turns]:
            if turn is not None and not turn.transcript.done():
                turn.transcript.cancel()
        for responder in self.services.responders.values():
            if (forget := getattr(responder, "forget", None)) is not None:
                forget(self.id)

