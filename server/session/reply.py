"""A duplex session's replies: responder text -> text chunks -> TTS -> paced audio deltas.

`ReplyPipeline` (one per session) runs each response as a task of the session: it waits
for the turn's transcript, streams the responder's text (as text deltas, and into clauses:
`Clauses`, server/lanes/clauses.py), has each clause synthesised on the TTS lane while the
responder goes on, and sends the audio as deltas at most `Limits.output_lead_ms` ahead of
the client's playback. `Response` records what was sent and what the client said it
played (playback.ack, conversation.item.truncate), which is what a cancelled or truncated
reply leaves in the conversation history (`heard_text`).

Every response has an epoch. Cancelling one (barge-in, response.cancel) bumps the epoch,
and the outbox drops media events of an older epoch, so a late result of a cancelled
response is never sent.

A response may be text only (`output_modality` "text": no TTS, no audio events; what was
sent of its text is what was heard), out of band (`conversation` "none": its reply never
joins the history), or stopped by its token limit (the responder's `Incomplete`:
response.done{incomplete, max_output_tokens}, after the .done events a completed one gets).
The history holds a reply as the message with the response's item id.

A reply may call functions (the responder's `CallDelta`s): each call is an output item of its
own (response.output_item.added, .function_call_arguments.delta, then at the reply's end
.function_call_arguments.done and .output_item.done), is not spoken, and joins the history
after the reply's message; response.done lists the calls, and the session waits for their
outputs (server/session/tool_calls.py). The server's own responses around a call (a filler, the
apology when a call times out) speak a fixed text instead of the responder's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from rtmedia.engines.asr.contract import normal_words
from rtmedia.engines.base import EngineError
from rtmedia.engines.responders.contract import (
    CallDelta,
    CallError,
    FunctionCall,
    Incomplete,
    Message,
    ReplyRequest,
    ResponderError,
    Waiting,
)
from rtmedia.engines.tts.piper import TtsItem, TtsStream
from rtmedia.protocol.events import server_event
from rtmedia.server.hearing.recognition import Turn
from rtmedia.server.lanes.access import Replies, Tts
from rtmedia.server.lanes.clauses import Clauses
from rtmedia.server.lanes.clock import SYSTEM_CLOCK, Clock
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.session.config import SessionSettings
from rtmedia.server.session.items import item_of
from rtmedia.server.session.limits import Limits
from rtmedia.server.session.outbox import Outbox
from rtmedia.server.session.tool_calls import Call

if TYPE_CHECKING:
    from rtmedia.server.observe.tracing import SessionTrace

log = logging.getLogger(__name__)
ACK_FRESH_S = 1.0  # an ack older than this no longer tells where playback is
# A long sentence is decoded in windows from this many latent frames (about half a second of audio at
# 22.05 kHz), doubling: its first audio comes after a quarter of its decode or less.
TTS_WINDOW_FRAMES = 48
PREEMPT_TTS_BEHIND = 2  # TTS items queued at which a pause prepares no reply (the lanes are behind)
TTS_DUE_MARGIN_S = 0.3  # a later TTS item is due this long before the audio before it runs out
# A reply's first audio starts this long before its first sound louder than QUIET_LEVEL (of int16 full
# scale): the voice's leading silence (0-60 ms) would only delay what the user hears.
LEAD_KEPT_MS = 10
QUIET_LEVEL = 66
PLAYED_TOLERANCE_MS = 40


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
    text_only: bool = False  # output_modality "text": nothing is synthesised
    joins_history: bool = True  # conversation "auto"; False: out of band ("none")
    text: str = ""  # the reply text sent so far
    done_at: float = 0.0  # when it ended (the session clock)
    cleared_at: float = 0.0  # the session clock at its output_audio_buffer.cleared (the client dropped the rest)
    filler: bool = False  # the server's filler while a function call is out
    calls: list[Call] = field(default_factory=list)  # the function calls it made, once it completed
    # Set while its audio may go out; cleared while voice heard over it is judged (a confirmed
    # interruption, server/session/interruptions.py).
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)
    # A preemptive reply (`ReplyPipeline.preempt`): its events are held here, and `released`
    # clear, until the turn it answers ends with the words it answers (`said`).
    held: list[Any] | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)
    turn: Turn | None = None
    said: tuple[str, ...] = ()
    preemptive: str = "none"  # "committed": it was prepared at a pause and sent at the turn's end
    synthesized_s: float = 0.0  # audio synthesised so far
    # The session clock's marks of its stages (response.timings): created, transcript in, first text,
    # first clause synthesised.
    created_at: float = 0.0
    transcript_at: float = 0.0
    first_text_at: float = 0.0
    first_audio_ready_at: float = 0.0

    def __post_init__(self) -> None:
        self.unpaused.set()
        self.released.set()

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

    def playback_end(self) -> float:
        """When the client's playback of this ended response ends or ended (the session clock): when
        its audio was cleared, where a truncate stopped it, the last ack plus what was left after
        it, else the first audio's time plus all the audio sent; never before it ended (a reply
        without audio ends when it ends)."""
        if self.cleared_at:
            end = self.cleared_at
        elif self.heard_ms is not None:
            end = self.heard_at + (0 if self.truncated else max(0, self.sent_ms - self.heard_ms) / 1000)
        elif self.first_audio_at:
            end = self.first_audio_at + self.sent_ms / 1000
        else:
            end = self.done_at
        return max(end, self.done_at)

    def timings(self) -> dict[str, Any]:
        """response.timings: each stage the time it added after the stage before ended (work
        done ahead counts 0), from the end of the turn's speech (its turn's, else the
        response's creation); absent: not reached."""
        turn = self.turn
        start = (turn.speech_end_at or turn.stopped_at) if turn is not None else 0.0
        start = start or self.created_at
        marks = (("turn_detection_ms", turn.stopped_at if turn is not None else start),
                 ("transcription_ms", self.transcript_at if turn is not None else start),
                 ("first_text_ms", self.first_text_at), ("first_audio_ms", self.first_audio_ready_at))
        out: dict[str, Any] = {"preemptive": self.preemptive}
        before = start
        for name, at in marks:
            if not at:
                break
            out[name] = round(max(0.0, at - before) * 1000)
            before = max(before, at)
        if self.first_audio_at:
            out["voice_to_voice_ms"] = round(max(0.0, self.first_audio_at - start) * 1000)
        return out

    def heard_text(self) -> str:
        """The reply as far as it was heard: whole clauses, then the played fraction
        of the current clause cut at a word boundary. Without acks, what was sent.
        A text-only reply: the text sent."""
        if self.text_only:
            return " ".join(self.text.split())
        heard = self.sent_ms if self.heard_ms is None else min(self.heard_ms, self.sent_ms)
        words: list[str] = []
        for text, start, end in self.clauses:
            if end <= heard:
                words += text.split()
            elif start < heard:
                clause = text.split()
                words += clause[: int(len(clause) * (heard - start) / (end - start))]
        return " ".join(words)


@dataclass(frozen=True, slots=True)
class ResponseDone:
    """A response's response.done was queued."""

    response: Response


# Builds the responder's request from the session's history: (instructions, max_tokens)
# -> ReplyRequest, each None for the session's setting.
RequestFactory = Callable[..., ReplyRequest]


class ReplyPipeline:
    """The responses of one session. `start()` begins one (the latest is `response`),
    `cancel()` stops it; `prepare()` / `forget()` tell the responders about the conversation.
    While a reply's first clause is synthesised, its responder's decoding is paused (a request
    to the scheduler: `replies.pause`), so that synthesis, which the user waits for, has the CPU.

    `conversation`: the session id (the responders' key); `settings`: the session's current
    settings; `request`: builds a ReplyRequest from the history; `spawn(coro, name)`: runs a
    task the session owns; `new_id(prefix)`: a fresh id; `notify`: told `ResponseDone` after a
    response's response.done was queued; `clock`: the session's."""

    def __init__(self, conversation: str, outbox: Outbox, history: list[Message], limits: Limits, *,
                 tts: Tts, replies: Replies, metrics: Metrics,
                 settings: Callable[[], SessionSettings], request: RequestFactory,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
                 new_id: Callable[[str], str], notify: Callable[[ResponseDone], None],
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.conversation = conversation
        self.clock = clock  # the session's (server/lanes/clock.py): pacing and playback marks
        self.outbox = outbox
        self.history = history  # the session's, shared
        self.limits = limits
        self.tts = tts
        self.replies = replies
        self.metrics = metrics
        self._settings = settings
        self._request = request
        self._spawn = spawn
        self._new_id = new_id
        self._notify = notify
        self.epoch = 0
        self.responses: dict[str, Response] = {}
        self.response: Response | None = None  # the latest response
        self.preemptive: Response | None = None  # prepared at a pause, held (see `preempt`)
        self.trace: SessionTrace | None = None  # the session's spans, when tracing is on (server/observe/tracing.py)

    @property
    def generating(self) -> bool:
        return self.response is not None and not self.response.done

    def _send(self, name: str, /, **fields: Any) -> None:
        self.outbox.control(server_event(name, **fields))

    def _send_media(self, response: Response, name: str, /, **fields: Any) -> None:
        if response.held is not None:
            response.held.append(server_event(name, **fields))
        else:
            self.outbox.media(response.epoch, server_event(name, **fields))

    # ---- responders -------------------------------------------------------------
    def prepare(self) -> None:
        """Speech started: a responder that can gets the reply's prompt ready, up to the user's words."""
        settings = self._settings()
        if settings.create_response:
            self._spawn(self.replies.prepare(settings.responder, self._request()), "prepare")

    def forget(self) -> None:
        """The session ended: every responder drops what it kept for the conversation."""
        self.replies.forget(self.conversation)

    # ---- a response ----------------------------------------------------------------
    def start(self, turn: Turn | None, instructions: str | None = None, max_tokens: int | None = None, *,
              modality: str | None = None, joins_history: bool = True, request_event_id: str = "",
              say: str | None = None, filler: bool = False, reason: str = "") -> Response:
        """A new response to the turn (None: to the history as it is); `modality` overrides the
        session's output_modality for it, and `joins_history=False` makes it out of band;
        `request_event_id`: the response.create that asked for it. `say`: the server's own words
        instead of the responder's (a `filler`, an apology), and `reason` its response.done's
        status_reason. The reply prepared for this turn at its pause, if any, is this response:
        it is sent as soon as the turn's transcript says the words are the same."""
        modality = modality or self._settings().output_modality
        spec, self.preemptive = self.preemptive, None
        if spec is not None and (spec.turn is not turn or say is not None or instructions is not None
                                 or max_tokens is not None or not joins_history or spec.text_only != (modality == "text")):
            self._discard(spec.task, spec, "other_response")
            spec = None
        response = spec or Response(self._new_id("resp"), self._new_id("item"), self.epoch,
                                    text_only=modality == "text", joins_history=joins_history, filler=filler,
                                    turn=turn, created_at=self.clock.now())
        self.responses[response.response_id] = response
        self.response = response
        self._send("response.created", response_id=response.response_id, item_id=response.item_id,
                   request_event_id=request_event_id, filler=filler)
        if spec is not None and turn is not None and spec.task is not None:
            response.task = self._spawn(self._adopt(response, spec.task, turn), "response")
        else:
            response.task = self._spawn(self._respond(response, turn, instructions, max_tokens, say, reason),
                                        "response")
        return response

    # ---- preemptive replies ---------------------------------------------------------------
    def preempt(self, turn: Turn, said: str, request: ReplyRequest) -> None:
        """The user paused with `said` so far in `turn`: the reply to `request` (the history and
        those words) is generated and its first clause synthesised now, at a lower priority than
        replies being heard, its events held. `start(turn)` commits it if the turn ends with the
        same words; anything else discards it unseen (`discard_preemptive`)."""
        self.discard_preemptive("replaced")
        response = Response(self._new_id("resp"), self._new_id("item"), self.epoch,
                            text_only=self._settings().output_modality == "text", held=[], turn=turn,
                            said=tuple(normal_words(said)), created_at=self.clock.now())
        response.released.clear()
        response.task = self._spawn(self._respond(response, None, None, None, request=request), "preemptive")
        self.preemptive = response
        self.metrics.preemptive.labels("started").inc()

    def preempt_at(self, turn: Turn, closing: bool, current: Callable[[Turn], bool]) -> None:
        """The user paused: once the recogniser's early final is in, the reply to the words so far
        is prepared (`preempt`) unless speech resumed or the turn is no longer `current` (ended,
        or judged as an interruption). Skipped, and counted, while the TTS or the responder's lane
        is behind: other sessions' replies first."""
        settings = self._settings()
        if not (settings.preemptive and settings.create_response and settings.transcription) \
                or self.generating or closing:
            return
        if self.tts.waiting >= PREEMPT_TTS_BEHIND or self.replies.behind(settings.responder):
            self.metrics.preemptive.labels("skipped").inc()
            return
        turn.spoke_after_pause = False
        cut = turn.cut_done
        assert cut is not None

        async def at_early_final() -> None:
            await asyncio.shield(cut)
            if current(turn) and turn.cut_done is cut and not turn.spoke_after_pause and turn.said \
                    and not self.generating and self._settings().preemptive:
                self.preempt(turn, turn.said, self._request(said=Message("user", turn.said, turn.item_id)))

        self._spawn(at_early_final(), "preempt")

    def discard_preemptive(self, why: str) -> None:
        """The prepared reply will not be this turn's (the user spoke on, the session changed)."""
        spec, self.preemptive = self.preemptive, None
        if spec is not None:
            self._discard(spec.task, spec, why)

    def _discard(self, task: asyncio.Task[Any] | None, response: Response, why: str) -> None:
        """A prepared reply goes unseen: `task`, which makes it, is cancelled (its responder call and
        TTS items are withdrawn with it)."""
        if task is not None:
            task.cancel()
        if self.trace is not None:
            self.trace.discarded(response)
        self.metrics.preemptive.labels("discarded").inc()
        self.metrics.preemptive_discarded_audio.inc(response.synthesized_s)
        log.debug("preemptive reply discarded", extra={"session_id": self.conversation, "why": why})

    async def _adopt(self, response: Response, prepared: asyncio.Task[None], turn: Turn) -> None:
        """The turn answered by a prepared reply has ended: once its transcript is in, the reply
        is sent (its held events, then its audio) if the words are those it answers, else it is
        made again for the transcript."""
        try:
            try:
                await asyncio.wait_for(asyncio.shield(turn.transcript), self.limits.transcript_wait_s)
            except TimeoutError:
                self._finish(response, "", "failed", "the transcript of the turn did not arrive in time")
                return
            response.transcript_at = self.clock.now()
            if tuple(normal_words(turn.said)) == response.said:
                response.epoch, response.preemptive = self.epoch, "committed"
                held, response.held = response.held or [], None
                for event in held:
                    self.outbox.media(response.epoch, event)
                response.released.set()
                self.metrics.preemptive.labels("committed").inc()
                await prepared
                return
            self._discard(prepared, response, "other_words")
            with contextlib.suppress(asyncio.CancelledError):
                await prepared
            response.held, response.said = None, ()
            response.text, response.clauses, response.calls = "", [], []
            response.first_text_at = response.first_audio_ready_at = 0.0
            response.released.set()
            await self._respond(response, turn, None, None)
        finally:
            prepared.cancel()

    async def _respond(self, response: Response, turn: Turn | None, instructions: str | None,
                       max_tokens: int | None, say: str | None = None, reason: str = "",
                       request: ReplyRequest | None = None) -> None:
        """Transcript -> responder text -> TTS clause by clause -> audio deltas. A clause's audio
        is sent as soon as it is synthesised (a long sentence's window by window), while the
        responder produces the next text; the stream's items are synthesised in order, one at a
        time, and other sessions' items run between the windows of a long sentence."""
        settings = self._settings()
        status, text = "completed", ""
        calls: dict[int, Call] = {}  # by the responder's index
        speech: _Speech | None = None
        try:
            if turn is not None:
                await asyncio.wait_for(asyncio.shield(turn.transcript), self.limits.transcript_wait_s)
                response.transcript_at = response.transcript_at or self.clock.now()
            request = request or self._request(instructions, max_tokens)
            tts = None if response.text_only else self.tts.open(settings.voice, settings.output_rate,
                                                                window_frames=TTS_WINDOW_FRAMES,
                                                                speed=settings.speed)
            speech = _Speech(self, response, settings, tts)
            if say is None and self.trace is not None:  # the responder's span; its traceparent goes upstream
                request = self.trace.responder_started(response, settings.responder, request)
            deltas = _words(say) if say is not None else self.replies.reply(settings.responder, request)
            async for delta in deltas:
                if not response.first_text_at and isinstance(delta, str | CallDelta):
                    response.first_text_at = self.clock.now()
                if isinstance(delta, CallDelta):
                    self._call_delta(response, calls, delta)
                    continue
                if isinstance(delta, CallError):  # a local LM's malformed call: the reply goes on
                    self._send_media(response, "error", code="invalid_function_call",
                                     message=f"{response.response_id}: {delta.message}; the reply goes on without it")
                    continue
                if isinstance(delta, Waiting):  # every LM slot is taken: the client is told
                    self._send_media(response, "response.waiting", response_id=response.response_id,
                                     reason="lm_slot", queue_position=delta.position)
                    continue
                if isinstance(delta, Incomplete):  # the token limit stopped the reply
                    status, reason = "incomplete", delta.reason
                    continue
                text += delta
                response.text = text
                self._send_media(response, "response.output_text.delta", response_id=response.response_id,
                                 item_id=response.item_id, delta=delta)
                await speech.feed(delta)
            if self.trace is not None:
                self.trace.responder_ended(response)
            await speech.end()
            await speech.finished()
        except TimeoutError:
            status, reason = "failed", "the transcript of the turn did not arrive in time"
        except Exception as exc:
            log.exception("response failed", extra={"session_id": self.conversation})
            # A responder's or engine's own words are the client's; anything else stays in the log.
            status, reason = "failed", (str(exc) if isinstance(exc, ResponderError | EngineError) else
                                        "an internal error; the server logged it with the session id")
        finally:
            if speech is not None:
                speech.cancel()
            self.replies.resume(settings.responder, self.conversation)
            if self.trace is not None:  # (a no-op once the responder's stream ended)
                self.trace.responder_ended(response, "failed" if status == "failed" else "cancelled")
        if status != "failed":
            response.calls = [calls[i] for i in sorted(calls)]
            text = text.rstrip() if response.calls else text  # the space before a call is not the reply's
        await response.released.wait()  # a held reply ends (and its calls go out) only once committed
        self._finish(response, text, status, reason)

    def _call_delta(self, response: Response, calls: dict[int, Call], delta: CallDelta) -> None:
        """A function call of the reply begins or goes on: its item, then its arguments' deltas.
        Its place in the response's output: the reply's message is 0, calls follow in the order
        they began."""
        call = calls.get(delta.index)
        if call is None:
            if not delta.name:
                raise ResponderError(f"the responder's function call {delta.index} began without a name")
            call = calls[delta.index] = Call(FunctionCall(self._new_id("call"), delta.name, ""),
                                             self._new_id("item"), output_index=len(calls) + 1)
            self._send_media(response, "response.output_item.added", response_id=response.response_id,
                             output_index=call.output_index, item=call_item(call, arguments=False))
        if delta.arguments:
            call.call = FunctionCall(call.call.call_id, call.call.name, call.call.arguments + delta.arguments)
            self._send_media(response, "response.function_call_arguments.delta", response_id=response.response_id,
                             item_id=call.item_id, output_index=call.output_index, call_id=call.call.call_id,
                             delta=delta.arguments)

    async def _send_audio(self, response: Response, clause: str, audio: bytes, rate: int) -> None:
        """Send one clause's audio as paced deltas and record where the clause lies."""
        start_ms = response.sent_ms
        step = rate * self.limits.output_delta_ms // 1000 * 2
        for offset in range(0, len(audio), step):
            piece = audio[offset:offset + step]
            while True:  # held, paused, or ahead of the client's playback: wait (a pause may come meanwhile)
                if not response.released.is_set():
                    await response.released.wait()
                if not response.unpaused.is_set():
                    await response.unpaused.wait()
                lead = response.sent_ms - response.played_ms(self.clock.now())
                if lead <= self.limits.output_lead_ms:
                    break
                await self.clock.sleep((lead - self.limits.output_lead_ms) / 1000)
            if not response.first_audio_at:
                response.first_audio_at = self.clock.now()
                turn = response.turn
                if turn is not None and turn.stopped_at:
                    self._observe_latency(response.first_audio_at - turn.stopped_at, turn.silence_ms)
            response.sent_samples += len(piece) // 2
            response.sent_ms = response.sent_samples * 1000 // rate
            self.metrics.bytes_total.labels("out").inc(len(piece))
            self._send_media(response, "response.output_audio.delta", response_id=response.response_id,
                             item_id=response.item_id, audio=piece, sample_rate=rate, channels=1)
        if clause and audio:
            response.clauses.append((clause, start_ms, response.sent_ms))
        elif audio and response.clauses and response.clauses[-1][2] == start_ms:  # its sentence's later window
            response.clauses[-1] = (*response.clauses[-1][:2], response.sent_ms)

    def _observe_latency(self, latency: float, silence_ms: int) -> None:
        self.metrics.response_latency.observe(latency)
        if silence_ms:  # a VAD turn
            self.metrics.voice_to_voice.observe(latency + silence_ms / 1000)

    def _finish(self, response: Response, text: str, status: str, reason: str) -> None:
        response.done, response.done_at = True, self.clock.now()
        rid, item = response.response_id, response.item_id
        if text and response.joins_history:
            self.history.append(Message("assistant", text, item))
        if status in ("completed", "incomplete"):
            self._send_media(response, "response.output_text.done", response_id=rid, item_id=item, text=text)
            if not response.text_only:
                self._send_media(response, "response.output_audio.done", response_id=rid, item_id=item)
        for call in response.calls:
            self._send_media(response, "response.function_call_arguments.done", response_id=rid,
                             item_id=call.item_id, output_index=call.output_index, call_id=call.call.call_id,
                             name=call.call.name, arguments=call.call.arguments)
            self._send_media(response, "response.output_item.done", response_id=rid, output_index=call.output_index,
                             item=call_item(call))
            if response.joins_history:
                self.history.append(Message("assistant", "", call.item_id, call=call.call))
        usage = {"output_tokens": len(text.split()), "output_audio_ms": response.sent_ms}
        self._send_media(response, "response.done", response_id=rid, status=status, status_reason=reason,
                         usage=usage, function_calls=[call_item(c) for c in response.calls],
                         timings=self._timings(response))
        if self.trace is not None:
            self.trace.response_done(response, status, reason, self._settings(), response.timings())
        self._notify(ResponseDone(response))

    def _timings(self, response: Response) -> dict[str, Any]:
        """The response's response.timings, each stage observed by its histogram."""
        timings = response.timings()
        responder = self._settings().responder
        for name, value in timings.items():
            if name != "preemptive":
                self.metrics.response_stage.labels(name.removesuffix("_ms"), responder).observe(value / 1000)
        return timings

    def pause(self) -> Response | None:
        """Voice over the latest response is being judged: its audio stops going out (the client
        plays what it has). Returns the response paused, None if there was none to pause."""
        response = self.response
        if response is None or response.text_only or not response.unpaused.is_set():
            return None
        response.unpaused.clear()
        return response

    def resume(self, response: Response) -> None:
        """The voice was no interruption: the paused response's audio goes on from where it
        stopped. The client played out what it had meanwhile, so playback is reckoned from now."""
        if response.unpaused.is_set():
            return
        now = self.clock.now()
        if response.first_audio_at and not (response.heard_ms is not None and now - response.heard_at < ACK_FRESH_S):
            response.first_audio_at = now - response.played_ms(now) / 1000
        response.unpaused.set()

    def cancel(self, reason: str) -> None:
        """Barge-in or response.cancel: stop generation, fence off its epoch, tell the client."""
        response = self.response
        if response is None:
            return
        was_generating = not response.done
        self.epoch += 1
        if response.task is not None:
            response.task.cancel()
        now = self.clock.now()
        if not response.text_only:  # a text-only reply has no audio to drop
            response.cleared_at = now
            self._send("output_audio_buffer.cleared", response_id=response.response_id,
                       audio_end_ms=response.sent_ms)
        if was_generating:
            response.done, response.done_at = True, now
            self._send("response.done", response_id=response.response_id, status="cancelled", status_reason=reason,
                       usage={"output_audio_ms": response.sent_ms}, timings=self._timings(response))
            text = response.heard_text()
            if text and response.joins_history:
                self.history.append(Message("assistant", text, response.item_id))
            self._notify(ResponseDone(response))
        else:
            self.truncate_history(response)
        if self.trace is not None:
            self.trace.cancelled(response, reason, was_generating, now, self._settings(), response.timings())

    def truncate_history(self, response: Response) -> None:
        """The response's assistant message becomes what the client heard of it."""
        for n, message in enumerate(self.history):
            if message.item_id == response.item_id:
                self.history[n] = Message("assistant", response.heard_text(), response.item_id)
                return


class _Speech:
    """The spoken side of one response (none for a text-only one, whose `stream` is None): its
    clauses go to the TTS stream one item at a time, in order (`Clauses`, server/lanes/clauses.py;
    each item submitted by `_submit`), and each item's audio to the client as soon as it is
    synthesised (`_send_all`), while the responder produces the next text (`feed`, `end`)."""

    def __init__(self, pipeline: ReplyPipeline, response: Response, settings: SessionSettings,
                 stream: TtsStream | None) -> None:
        self.pipeline = pipeline
        self.response = response
        self.settings = settings
        self.stream = stream
        self.submitted = 0  # TTS items submitted
        self.playing_from: float | None = None  # (loop time) when the first audio was ready
        self.audio_s = 0.0  # audio synthesised so far
        self.synthesis: asyncio.Future[bytes] | None = None  # the item submitted last
        self.clauses: Clauses | None = None
        self.sender: asyncio.Future[None] | None = None
        if stream is not None:
            self.clauses = Clauses(stream, self._submit)
            self.sender = asyncio.ensure_future(self._send_all(self.clauses, stream.output_rate))

    async def _send_all(self, clauses: Clauses, rate: int) -> None:
        response = self.response
        async for clause in clauses:
            pcm = clause.audio
            if not response.sent_samples:
                pcm = trim_lead(pcm, rate)
            await self.pipeline._send_audio(response, clause.text, pcm, rate)

    def _submit(self, item: TtsItem) -> Coroutine[Any, Any, bytes]:
        """One TTS item of the stream (a clause, or a later window of its long sentence), submitted
        now. The first is due at once (the user is waiting); each later one when the audio before
        it would run out at the client, less TTS_DUE_MARGIN_S (the lane runs the item due soonest,
        so a session about to run dry goes before one with audio to spare)."""
        pipeline, response, settings = self.pipeline, self.response, self.settings
        due = None if self.playing_from is None else self.playing_from + self.audio_s - TTS_DUE_MARGIN_S
        priority = Priority.REALTIME if response.released.is_set() else Priority.INTERACTIVE
        submitted = pipeline.clock.now() if pipeline.trace is not None else 0.0
        self.synthesis = asyncio.ensure_future(pipeline.tts.synthesize(item, priority, due))
        self.submitted += 1
        if self.submitted == 1:  # the first clause: the responder waits until it is spoken
            pipeline.replies.pause(settings.responder, pipeline.conversation)
            self.synthesis.add_done_callback(lambda _: pipeline.replies.resume(settings.responder,
                                                                               pipeline.conversation))
        return self._synthesized(self.synthesis, item.text, submitted)

    async def _synthesized(self, synthesis: asyncio.Future[bytes], text: str, submitted: float) -> bytes:
        """The item's audio, once the response's timings and the next item's due time count it."""
        response, pipeline, tts = self.response, self.pipeline, self.stream
        assert tts is not None
        audio = await synthesis
        if not response.first_audio_ready_at:
            response.first_audio_ready_at = pipeline.clock.now()
        self.audio_s += (clause_s := len(audio) / 2 / tts.output_rate)
        if pipeline.trace is not None:
            pipeline.trace.clause(response, text, submitted, pipeline.clock.now(), clause_s)
        response.synthesized_s = self.audio_s
        if self.playing_from is None and self.audio_s:
            self.playing_from = asyncio.get_running_loop().time()
        return audio

    async def feed(self, delta: str) -> None:
        """The responder's next text: the clauses it completes are queued for the TTS."""
        if self.clauses is not None:
            await self._speak(self.clauses.cut(delta))

    async def end(self) -> None:
        """The responder's text is complete: its rest is queued, then the stream's closing item."""
        if self.clauses is not None:
            await self._speak(self.clauses.cut_rest())
            self.clauses.end()  # flushes the resampler's tail

    async def _speak(self, clauses: list[str]) -> None:
        assert self.clauses is not None and self.sender is not None
        for clause in clauses:
            if self.clauses.last is not None:  # the responder waits for the TTS item submitted last (the LM's pacing)
                await asyncio.wait([self.clauses.last])
                await self.response.released.wait()  # a held reply prepares its first clause only
            if self.sender.done():
                self.sender.result()  # sending failed: raise it here
            self.clauses.put(clause)

    async def finished(self) -> None:
        """Once the text has ended: every item synthesised and its audio sent."""
        if self.sender is not None:
            await self.sender

    def cancel(self) -> None:
        if self.clauses is not None:
            self.clauses.cancel()
        for task in (self.synthesis, self.sender):
            if task is not None:
                task.cancel()


def trim_lead(pcm: bytes, rate: int) -> bytes:
    """PCM16 without its leading silence but LEAD_KEPT_MS (all of it when it holds no sound)."""
    loud = np.flatnonzero(np.abs(np.frombuffer(pcm, "<i2").astype(np.int32)) > QUIET_LEVEL)
    return pcm[2 * max(0, int(loud[0]) - rate * LEAD_KEPT_MS // 1000):] if loud.size else pcm


def call_item(call: Call, arguments: bool = True) -> dict[str, str]:
    """A function call as the events carry it: its conversation item (`arguments=False`: with
    its arguments still empty, as response.output_item.added has it)."""
    item = item_of(Message("assistant", "", call.item_id, call=call.call))
    return item if arguments else {**item, "arguments": ""}


async def _words(text: str) -> Any:
    """The server's own words as a reply stream: one word per delta, like a responder's."""
    words = text.split()
    for n, word in enumerate(words):
        yield word if n == len(words) - 1 else word + " "
        await asyncio.sleep(0)
