"""A duplex speech session: one Converse stream (docs/protocol.md#sessions).

`Session` holds the session's lifecycle (open, finish, drain, close), its config, turn state,
audio input, camera frames and history, and turns the VAD tick's results into turns. The rest
is in the parts it owns, one each (docs/architecture.md draws them): the client events' table
(client_events.py), the outbox, the recogniser feed and its transcription events
(transcripts.py), the reply pipeline (reply.py), the conversation items, the interruption
machine (interruptions.py), the idle turns, the function calls' wait (tool_calls.py) and
semantic_vad's decisions (server/hearing/semantic_turns.py). The session never calls an
engine: it and its parts use the scheduler's typed handles (server/lanes/access.py). Every
timer runs on the context's clock (server/lanes/clock.py); every task is owned here and cancelled by `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from rtmedia.engines.responders.contract import Message
from rtmedia.protocol.events import server_event
from rtmedia.protocol.turn_kinds import MANUAL, SEMANTIC_VAD
from rtmedia.server.hearing.audio_input import Action, AudioInput, Stop
from rtmedia.server.hearing.recognition import Delta, Fault, Heard, Recognizer, Transcribed, Turn
from rtmedia.server.hearing.semantic_turns import SemanticTurns, TurnEnds
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.session.client_events import ClientEvents
from rtmedia.server.session.config import SessionSettings, reply_request
from rtmedia.server.session.context import SessionContext
from rtmedia.server.session.idle_turns import IdleTurns
from rtmedia.server.session.interruptions import Interruptions
from rtmedia.server.session.items import ConversationItems
from rtmedia.server.session.limits import Limits
from rtmedia.server.session.outbox import Outbox, OutboxFailed
from rtmedia.server.session.reply import TTS_WINDOW_FRAMES, ReplyPipeline, Response, ResponseDone
from rtmedia.server.session.tool_calls import ToolCalls
from rtmedia.server.session.transcripts import Transcripts
from rtmedia.v1 import realtime_pb2

# Re-exported: other modules import these from here (Limits, SessionContext: server/app.py and
# server/services/realtime.py; TTS_WINDOW_FRAMES: tests/perf/bench_speech.py).
__all__ = ["TTS_WINDOW_FRAMES", "Limits", "Session", "SessionContext"]

log = logging.getLogger(__name__)
ARRIVALS = 3000  # input chunks whose arrival times are kept (a turn's end is looked up among them)


class Session:
    """One Converse stream. `handle()` takes client events; the service's writer
    loop writes what `outbox.get()` returns."""

    def __init__(self, session_id: str, context: SessionContext, settings: SessionSettings) -> None:
        self.id = session_id
        self.context = context
        access = self.access = context.access
        self.metrics = access.metrics
        self._bytes_in = access.metrics.bytes_total.labels("in")
        self.settings = settings
        self.limits: Limits = context.limits
        self.clock = context.clock
        self.outbox = Outbox(self.limits.max_outbox_events, self.limits.max_outbox_bytes, self.notify)
        self.writer: asyncio.Task[Any] | None = None  # the servicer's writer, ended if the outbox fails
        self.started = time.monotonic()
        self.last_input = self.started
        self.closing_reason: str | None = None
        self.caller: str | None = None  # the name of the token it was opened with (--auth-tokens)
        self.transport = "grpc"  # how the client reached it (metadata rtmedia-transport)
        self._ids = itertools.count(1)
        self.client_ids: set[str] = set()  # item ids the client chose: the server's own skip them
        self.history: list[Message] = []  # the conversation, each message under its item id
        self.turn: Turn | None = None  # the turn being spoken, or buffered for a commit
        # Committed turns (manual, none) whose audio is still on its way through the VAD tick,
        # oldest first: the audio the tick delivers goes to the first of them, not to `turn`.
        self._committing: deque[Turn] = deque()
        self.buffer_ms = 0.0  # uncommitted input audio (manual / none)
        self._since_commit_ms = 0.0  # of it, what came after the last commit asked for
        self.speech_start_ms = 0
        self._asr_samples = 0  # 16 kHz samples sent to the recogniser
        self.input_ms = 0.0  # input audio appended so far
        self._arrivals: deque[tuple[float, float]] = deque(maxlen=ARRIVALS)  # (input_ms after a chunk, the clock then)
        self.camera: deque[bytes] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.replies = ReplyPipeline(
            self.id, self.outbox, self.history, self.limits,
            tts=access.tts, replies=access.replies,
            metrics=access.metrics, settings=lambda: self.settings,
            request=lambda *a, **k: reply_request(self.settings, self.history, self.camera, self.id, *a, **k),
            spawn=self.spawn, new_id=self.new_id, notify=self.notify, clock=self.clock,
        )
        self.items = ConversationItems(self)
        self.tools = ToolCalls(lambda: self.settings, self.limits, self.replies,
                               lambda: self.closing_reason is not None, self.clock)
        self.idle = IdleTurns(self, self.clock)
        self.interruptions = Interruptions(self)
        self.transcripts = Transcripts(self.id, self.send, self.interruptions)
        self.pending_turns = self.transcripts.pending  # committed turns not yet transcribed, oldest first
        self.recognizer = Recognizer(
            access.asr, fast_final=True, language=settings.language, priority=Priority.REALTIME,
            notify=self.notify, report_faults=True)
        self.input = AudioInput(settings, self.limits.inbox_ms, self.on_audio, access.vad.open())
        access.vad.attach(self.input)
        self.semantic = SemanticTurns(self.id, access.turns, self.metrics, lambda: self.settings,
                                      self.notify, self.spawn, self.limits.turn_thresholds)
        self.track(self.recognizer.start(f"session-{self.id}-asr"))
        self.client_events = ClientEvents(self)
        self.handle, self.settled = self.client_events.handle, self.client_events.settled
        if settings.noise_reduction:
            self.client_events.noise_reduction(settings.noise_reduction)
        # What the parts tell the session, one way (`notify`), by the event's type.
        self.on: dict[type, Callable[[Any], None]] = {
            Heard: self.interruptions.heard, Delta: self.transcripts.delta, Fault: self.transcripts.failed,
            Transcribed: lambda done: self._complete(done.turn), TurnEnds: self._end_turn_at,
            ResponseDone: self._response_done, OutboxFailed: self._outbox_failed}

    def notify(self, event: object) -> None:
        self.on[type(event)](event)

    # ---- helpers ---------------------------------------------------------
    def new_id(self, prefix: str) -> str:
        while (new := f"{prefix}_{self.id[-6:]}_{next(self._ids)}") in self.client_ids:
            pass
        return new

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self.track(asyncio.create_task(coro, name=f"session-{self.id}-{name}"))

    def track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("session task failed", exc_info=task.exception(), extra={"session_id": self.id})
            self.error("server_error", "an internal error stopped part of the session; the server logged it "
                       "with the session id")

    def send(self, name: str, /, **fields: Any) -> None:
        self.outbox.control(server_event(name, **fields))

    def error(self, code: str, message: str, event_id: str = "", param: str = "") -> None:
        self.outbox.control(server_event("error", code=code, message=message, event_id=event_id, param=param))

    def created_event(self) -> realtime_pb2.ConverseResponse:
        limits = self.limits.to_proto(self.context.max_sessions, self.context.lm_slots)
        return server_event("session.created", session_id=self.id, session=self.settings.to_proto(), limits=limits)

    @property
    def response(self) -> Response | None:
        """The latest response."""
        return self.replies.response

    @property
    def responding(self) -> bool:
        return self.replies.generating

    # ---- audio results from the VAD tick ----------------------------------
    def on_audio(self, actions: list[Action]) -> None:
        semantic = self.settings.turn_type == SEMANTIC_VAD
        for kind, value in actions:
            if kind == "started":
                self._on_speech_started(value)
            elif kind == "audio":
                if self.settings.transcription:
                    offset_ms, pcm = value
                    turn = self._committing[0] if self._committing else self.turn or self._start_turn()
                    if turn.input_offset_ms is None:
                        turn.input_offset_ms, turn.asr_offset_ms = offset_ms, self._asr_samples // 16
                    self._asr_samples += len(pcm) // 2
                    self.recognizer.send("audio", turn, pcm)
                    if semantic:
                        self.semantic.audio(pcm)
                    if turn is self.turn:
                        self.interruptions.lasted(offset_ms + len(pcm) // 32)
                    if turn.cut_done is not None and not turn.spoke_after_pause:  # speech resumed after a pause
                        turn.spoke_after_pause = True
                        if self.replies.preemptive is not None and self.replies.preemptive.turn is turn:
                            self.replies.discard_preemptive("speech_resumed")
            elif kind == "pause":
                voice = self.interruptions.voice is not None and self.settings.transcription
                if self.turn is not None and (self.limits.early_finals or semantic or voice):
                    self.turn.cut_done = asyncio.get_running_loop().create_future()
                    self.recognizer.send("cut", self.turn)
                    if voice:
                        self.interruptions.paused(self.turn)
                    else:
                        self.replies.preempt_at(self.turn, self.closing_reason is not None,
                                                lambda t: self.turn is t and self.interruptions.voice is None)
                        if semantic:
                            self.semantic.paused(self.turn)
            elif kind == "candidate":
                if self.turn is not None and semantic and self.interruptions.voice is None:
                    self.semantic.candidate(self.turn, *value)
            elif kind == "stopped":
                self._on_speech_stopped(value)
            elif kind == "marker":
                value()

    def _end_turn_at(self, decided: TurnEnds) -> None:
        """semantic_vad decided: the turn ends at the VAD tick's step, woken for it."""
        self.input.end_turn(decided.stop)
        self.access.vad.wake()

    def _start_turn(self) -> Turn:
        self.turn = Turn(self.new_id("item"), asyncio.get_running_loop().create_future())
        return self.turn

    def _end_turn(self) -> None:
        """The turn being spoken ends with all its audio delivered: committed, and its end
        heard by the recogniser."""
        turn, self.turn = self.turn, None
        if turn is None:
            return
        self._committed(turn)
        self._finish_recognition(turn)

    def _committed(self, turn: Turn) -> None:
        """input_audio_buffer.committed: the turn is pending until its transcript is in."""
        turn.stopped_at = self.clock.now()
        self.pending_turns.append(turn)
        self.send("input_audio_buffer.committed", item_id=turn.item_id, audio_ms=turn.audio_ms)

    def _finish_recognition(self, turn: Turn) -> None:
        """All the turn's audio went to the recogniser: its transcript follows (empty without
        transcription)."""
        if self.settings.transcription:
            self.recognizer.send("end", turn)
        else:
            turn.transcript.set_result("")

    def _on_speech_started(self, start_ms: int) -> None:
        self.idle.cancel()
        self.interruptions.next_voice()
        self.replies.discard_preemptive("speech_started")
        turn = self._start_turn()
        self.speech_start_ms = start_ms
        interrupts = self.settings.interrupt_response and self.response is not None \
            and self.response.audible(self.clock.now())
        if interrupts and self.settings.interruption.mode == "confirmed" and \
                self.interruptions.judge(turn, start_ms, self.input.collected_at, self.settings.interruption):
            return
        self.tools.stop()  # the user moved on: no filler or apology over them
        self.send("input_audio_buffer.speech_started", item_id=turn.item_id, audio_start_ms=start_ms)
        if interrupts:
            started = self.input.collected_at
            self.replies.cancel("turn_detected")
            self.metrics.barge_in.observe(self.clock.now() - started)
        self.turn_begun()

    def interruption_heard(self, turn: Turn, stop: Stop) -> None:
        """A judged voice was an interruption and its transcript is in: its speech_stopped,
        commit and transcript follow, as any turn's (the user may have begun another turn
        meanwhile: that one stays the turn being spoken)."""
        speaking, self.turn = self.turn, turn
        self._on_speech_stopped(stop, recognised=True)
        self.turn = speaking
        self._complete(turn)

    def turn_begun(self) -> None:
        self.replies.prepare()  # the reply's prompt, up to the user's words
        if self.settings.turn_type == SEMANTIC_VAD:
            said = [m.text for m in self.history if m.role == "assistant" and m.text]
            self.semantic.started(said[-1] if said else "")

    def _on_speech_stopped(self, stop: Stop, recognised: bool = False) -> None:
        """The turn ends; `recognised`: its transcript is in already (a judged voice's)."""
        if self.interruptions.judging(self.turn):
            turn, self.turn = self.turn, None
            self._finish_recognition(turn)
            self.interruptions.ended(turn, stop)
            return
        turn = self.turn or self._start_turn()
        end_ms = stop.audio_end_ms
        turn.speech_end_at = self._arrival(end_ms)
        self.send("input_audio_buffer.speech_stopped", item_id=turn.item_id, audio_end_ms=end_ms,
                  reason=stop.proto_reason, score=stop.score)
        self.metrics.turn_ends.labels(stop.reason).inc()
        self.semantic.ended()
        turn.silence_ms, turn.end_reason = stop.silence_ms, stop.reason
        turn.audio_ms = end_ms - max(0, self.speech_start_ms - self.settings.prefix_padding_ms)
        if recognised:
            self.turn = None
            self._committed(turn)
        else:
            self._end_turn()
        self.idle.quiet()
        if self.settings.create_response and self.closing_reason in (None, "server_shutdown"):
            if self.responding:  # interrupt_response off: the new turn waits its turn
                self.replies.discard_preemptive("response_in_progress")
                self.error("response_in_progress", "a turn ended while a response is in progress; "
                           "it is in the history but gets no response of its own")
                return
            self.replies.start(turn)
        else:
            self.replies.discard_preemptive("no_response")
            self.idle.arm()
        self.close_if_drained()

    def _arrival(self, input_ms: float) -> float:
        """When the input up to `input_ms` had arrived (on the session clock); 0: not known."""
        at = 0.0
        for end_ms, t in reversed(self._arrivals):
            if end_ms < input_ms:
                break
            at = t
        return at

    # ---- recognition results (server/hearing/recognition.py) ---------------------------
    def _complete(self, turn: Turn) -> None:
        """A committed turn's transcript is in: the turn joins the history (as an item, even when
        nothing was recognised; the responders see only messages with words)."""
        if self.interruptions.completed(turn):
            return
        self.transcripts.completed(turn)
        self.history.append(Message("user", turn.said, turn.item_id))
        self.close_if_drained()

    # ---- lifecycle ---------------------------------------------------------------
    def finish(self, reason: str) -> None:
        """Close the session with session.closed{reason}; a response in flight is cancelled,
        unless the server is draining: then what is in flight finishes first (see `draining`)."""
        if self.closing_reason is not None:
            return
        self.closing_reason = reason
        self.idle.cancel()
        if reason == "server_shutdown":
            self.close_if_drained()
            return
        if self.responding:
            self.replies.cancel(reason)
        self.outbox.close(server_event("session.closed", reason=reason))

    @property
    def in_flight(self) -> bool:
        """A turn being spoken (or buffered for a manual commit), a response being asked for or
        given, or a finished turn whose transcript is still being recognised."""
        manual_buffer = self.settings.turn_type == MANUAL and self.buffer_ms > 0
        transcribing = any(not turn.transcript.done() for turn in self.pending_turns)
        return self.turn is not None or manual_buffer or self.responding or transcribing

    def close_if_drained(self) -> None:
        """Draining (server_shutdown): the session closes once nothing is in flight: a turn the
        user is speaking is heard to its end and answered, and the reply goes out in full."""
        if self.closing_reason == "server_shutdown" and not self.outbox.closed and not self.in_flight:
            self.outbox.close(server_event("session.closed", reason=self.closing_reason))

    def _response_done(self, done: ResponseDone) -> None:
        """A response's response.done is queued: one that called functions makes the session wait
        for their outputs; when draining, the session may close now; else the idle-turn timer
        runs from the end of its playback."""
        response = done.response
        self.idle.quiet_input_ms = self.input_ms
        if response.calls and self.closing_reason is None:
            self.tools.made(response.calls)
        self.close_if_drained()
        self.idle.arm()

    def _outbox_failed(self, _: OutboxFailed) -> None:
        """The client kept not reading (server/session/outbox.py): the session ends at once, and the
        writer, which may be waiting on a client that never reads, is stopped."""
        if self.closing_reason is None:
            self.closing_reason = "client_too_slow"
        if self.replies.generating:
            self.replies.cancel("client_too_slow")
        if self.writer is not None:
            self.writer.cancel()

    def shutdown_now(self) -> None:
        """The drain grace period ended: close even if a response is still running."""
        if self.responding:
            self.replies.cancel("server_shutdown")
        self.outbox.close(server_event("session.closed", reason="server_shutdown"))

    async def close(self) -> None:
        """Free every resource of the session: tasks, VAD row, recogniser state."""
        self.idle.cancel()
        self.tools.stop()
        self.semantic.ended()  # the scorer's slot
        self.access.vad.detach(self.input)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 5)
        await self.recognizer.close()
        await self.items.close()
        for turn in [self.turn, *self.pending_turns]:
            if turn is not None and not turn.transcript.done():
                turn.transcript.cancel()
        self.replies.forget()

