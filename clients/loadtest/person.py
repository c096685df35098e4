"""One simulated person of `rtmedia loadtest` (rtmedia.clients.loadtest.harness): a session, a
sender that streams speech at real-time pace and acknowledges the reply it is "playing", and a
reader that measures the server's events as they arrive. `Person` is the Converse stream;
rtmedia.clients.loadtest.openai_ws.SocketPerson is the same person on the Realtime API."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from rtmedia.clients import events
from rtmedia.clients.commands import talk_session
from rtmedia.clients.credentials import (
    status_refusal,
    token_of,
)
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.loadtest.settings import (
    BARGE_AFTER_S,
    CLOSE_WAIT_S,
    CONFIG_ID,
    GAP_S,
    PAUSE_S,
    QUIET_S,
    RESPONDERS,
    STARTED_BACK_MS,
)
from rtmedia.clients.loadtest.speech import (
    Clip,
)
from rtmedia.clients.session import RealtimeSession
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2

if TYPE_CHECKING:
    from rtmedia.clients.loadtest.run import Run

# ---- one simulated person --------------------------------------------------------------------------

@dataclass
class Utterance:
    start_ms: float  # first and last voiced sample, in the session's input audio
    end_ms: float
    vad_seen: bool = False
    resumes_ms: float | None = None  # a paused sentence: where the voice resumes after the pause
    premature: bool = False  # a turn ended in its pause


@dataclass
class Reply(talk_session.Reply):
    """`rtmedia talk`'s simulated playback of a reply, plus when its last delta arrived
    and how long it plays (for jitter), and its assistant item (for a truncate)."""

    last_t: float = 0.0
    last_s: float = 0.0
    item_id: str = ""
    over: str = ""  # the kind of the latest voice said over it (speech, backchannel, noise)
    held_at: float | None = None  # paused here while voice over it is judged (confirmed interruptions)

    def played_ms(self, now: float) -> int:
        return super().played_ms(now if self.held_at is None else min(now, self.held_at))

    def playing(self, now: float) -> bool:
        return super().playing(now) or (self.held_at is not None and not self.cleared)


class Person:
    """One simulated user: a session, a sender (speech at real-time pace, playback acks) and
    a reader (the server's events, measured as they arrive). This class is the Converse
    stream; rtmedia.clients.loadtest.openai_ws.SocketPerson is the same person on the Realtime
    API's WebSocket. Both turn their events into the calls of "server events" below, where
    everything is measured."""

    def __init__(self, run: Run, index: int, profile: str) -> None:
        self.run, self.index, self.profile = run, index, profile
        self.rng = random.Random(run.args.seed * 1_000_003 + index)
        self.stats = run.stats
        self.responds = profile in RESPONDERS
        self.transcribes = profile != "listen"
        self.barge_share = run.args.barge_in_share if profile == "barge-in" else 0.0
        self.session: RealtimeSession | None = None
        self.ended = False
        self.cancelled = False  # by the sender, after the server did not close in time
        self.admitted = False
        self.opened = asyncio.Event()  # session.created came, or the stream ended
        self.closed_reason = ""
        self.silence_ms = 500
        self.sent_t: list[float] = []  # send time of every chunk
        self.utterances: list[Utterance] = []
        self.current: Clip | None = None
        self.pos = 0
        self.next_speech: float | None = None
        self.barge_at: float | None = None
        self.awaiting_since: float | None = None  # an utterance ended and no response was created since
        self.last_end = 0.0
        self.last_started: tuple[float, Utterance | None] | None = None
        self.trigger: tuple[float, float | None] | None = None
        self.stopped_at: dict[str, float] = {}
        self.live_replies: list[Reply] = []  # created, and not yet played out, acknowledged or cleared
        self.latencies: list[float] = []
        self.errors = 0
        self.underruns = 0

    # ---- lifecycle -------------------------------------------------------------------------------
    # What a send raises when the session ended under the sender (the reader records why).
    SENDER_ENDED: tuple[type[BaseException], ...] = (RtmediaError, grpc.RpcError, grpc.aio.UsageError,
                                                     asyncio.InvalidStateError)

    async def live(self, start_at: float) -> None:
        """The person's whole session: open at `start_at`, speak until the run stops, close."""
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        if time.perf_counter() >= self.run.stop_at:
            return
        stats = self.stats
        stats.started += 1
        stats.active += 1
        reader: asyncio.Task[None] | None = None
        try:
            if not await self.open():
                return
            reader = asyncio.create_task(self.read(), name=f"loadtest-{self.index}-read")
            await self.speak()
            if not self.ended:
                await self.end(reader)
        except TimeoutError:
            self.error("close_timeout")
        except self.SENDER_ENDED:
            pass
        finally:
            stats.active -= 1
            if reader is not None:
                await self.stop_reader(reader)

    async def open(self) -> bool:
        """Start the session; False when it was refused (and counted as such)."""
        self.session = RealtimeSession(channel=self.run.channel_for(self.index))
        return True

    async def end(self, reader: asyncio.Task[None]) -> None:
        """The client's end of the session, and the server's answer to it."""
        await self.session.event("session.close")
        await self.session.end_input()
        await asyncio.wait_for(asyncio.shield(reader), CLOSE_WAIT_S)

    async def stop_reader(self, reader: asyncio.Task[None]) -> None:
        if not reader.done() and not self.session.call.done():  # a finished call: the reader records why
            self.cancelled = True
            self.session.cancel_stream()
        await asyncio.gather(reader, return_exceptions=True)

    def error(self, code: str) -> None:
        self.errors += 1
        self.stats.error(code)

    async def read(self) -> None:
        try:
            self.on_event(await self.session.open(), time.perf_counter())
            async for event in self.session.events():
                self.on_event(event, time.perf_counter())
            if self.closed_reason == "client":
                self.stats.completed += 1
            else:
                self.error(f"closed:{self.closed_reason or 'no_session_closed'}")
        except RtmediaError as exc:
            reason = exc.reason
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and (not self.admitted or reason == "QUOTA"):
                self.stats.rejected += 1  # at capacity (AT_CAPACITY, MAX_SESSIONS) or over the token's quota (QUOTA)
            elif exc.code == grpc.StatusCode.UNAUTHENTICATED:  # so would every other session be: stop
                self.run.fail(status_refusal(exc.code, exc.details, exc.reason, exc.metadata,
                                            bool(token_of(self.run.args))) or "UNAUTHENTICATED")
            elif not self.cancelled:
                self.error(f"grpc:{exc.code.name}" + (f":{reason}" if reason else ""))
        finally:
            self.ended = True
            self.opened.set()

    # ---- what this transport sends -----------------------------------------------------------------
    async def send(self, msg: Any) -> None:
        """One client event: a chunk of run.clips or run.silence, or one this class made."""
        await self.session.send(msg)  # type: ignore[union-attr]

    def config_event(self) -> Any:
        return client_event("session.update", event_id=CONFIG_ID, session=self.run.configs[self.profile])

    async def send_ack(self, reply: Reply, played_ms: int) -> None:
        await self.send(client_event("playback.ack", response_id=reply.response_id, played_ms=played_ms))

    # ---- the sender ------------------------------------------------------------------------------
    async def speak(self) -> None:
        run, chunk_s = self.run, self.run.chunk_ms / 1000
        # The first write waits until the server admitted the session, as a client waiting for
        # session.created does: a refusal at capacity then never races a write (which gRPC
        # reports as INTERNAL instead of the server's RESOURCE_EXHAUSTED).
        await self.opened.wait()
        if self.ended:
            return
        await self.send(self.config_event())
        t0 = time.perf_counter()
        self.next_speech = t0 + self.rng.uniform(0.3, 1.5)
        n = 0
        while not self.ended:
            now = time.perf_counter()
            if now >= run.stop_at and self.finished(now):
                return
            if now >= run.drain_at:
                if self.awaiting_since is not None or any(not r.status for r in self.live_replies):
                    self.error("unfinished_at_stop")
                return
            msg = self.next_chunk(now, n, now < run.stop_at)
            self.sent_t.append(now)
            await self.send(msg)
            await self.acknowledge(now)
            n += 1
            self.stats.chunks += 1
            lag = time.perf_counter() - (t0 + n * chunk_s)
            if lag < 0:
                await asyncio.sleep(-lag)
            elif lag > chunk_s:
                self.stats.late_chunks += 1
                self.stats.max_send_lag_ms = max(self.stats.max_send_lag_ms, lag * 1000)

    def next_chunk(self, now: float, n: int, may_start: bool) -> Any:
        if self.current is None:
            if self.awaiting_since is not None and now - self.awaiting_since > self.run.args.reply_timeout:
                self.error("no_response")
                self.awaiting_since = None
            if self.responds and self.next_speech is None and self.awaiting_since is None and self.replies_done(now):
                self.next_speech = now + self.rng.uniform(*GAP_S)
            due = [t for t in (self.next_speech, self.barge_at) if t is not None]
            if not (may_start and due and now >= min(due)):
                return self.run.silence
            over = self.barge_at is not None and now >= self.barge_at
            clip = self.current = self.pick(over)
            self.pos, self.next_speech, self.barge_at = 0, None, None
            base = n * self.run.chunk_ms
            resumes = None if clip.pause_ms is None else base + clip.pause_ms[1]
            self.utterances.append(Utterance(base + clip.voice_start_ms, base + clip.voice_end_ms, resumes_ms=resumes))
            playing = self.playing_reply(now)
            for reply in self.live_replies:  # a cancel is the latest voice's doing
                reply.over = clip.kind if over and reply is playing else ""
            if over and playing is not None:
                self.stats.over[clip.kind] += 1
            self.stats.turns += clip.kind == "speech"
            self.stats.paused_turns += resumes is not None
        msg = self.current.chunks[self.pos]
        self.pos += 1
        if self.pos == len(self.current.chunks):
            kind, self.current, self.last_end = self.current.kind, None, now
            if self.responds:
                if kind == "speech":  # a backchannel or a burst asks for nothing
                    self.awaiting_since = now
            else:
                self.next_speech = now + self.rng.uniform(*PAUSE_S)
        return msg

    def pick(self, over: bool) -> Clip:
        """The next utterance: over a reply, a backchannel or a noise burst by their shares."""
        run, args = self.run, self.run.args
        roll = self.rng.random() if over and (args.backchannel_share or args.noise) else 1.0
        pool = run.plain
        if roll < args.backchannel_share:
            pool = run.backchannels
        elif roll < args.backchannel_share + args.noise:
            pool = run.noises
        elif run.paused and self.rng.random() < args.paused_share:
            pool = run.paused
        return pool[self.rng.randrange(len(pool))]

    def playing_reply(self, now: float) -> Reply | None:
        """The reply being played now, if one is."""
        return next((r for r in self.live_replies if r.first_audio_t is not None and not r.cleared
                     and r.playing(now)), None)

    def replies_done(self, now: float) -> bool:
        return all(r.status and not r.playing(now) for r in self.live_replies)

    def finished(self, now: float) -> bool:
        return (self.current is None and self.awaiting_since is None and not self.stopped_at
                and self.replies_done(now) and now - self.last_end >= QUIET_S)

    async def acknowledge(self, now: float) -> None:
        """playback.ack every ~200 ms of play, and once a reply has played out (send_ack:
        transports without acks only count); replies that are over (acknowledged to the end,
        cleared, or done without audio) leave live_replies."""
        if not self.live_replies:
            return
        over = []
        for reply in list(self.live_replies):  # the reader may add a reply while a write is awaited
            if reply.cleared or (reply.status and reply.first_audio_t is None):
                over.append(reply)
            elif reply.first_audio_t is not None:
                played = reply.played_ms(now)
                finished = bool(reply.status) and not reply.playing(now)
                ack = reply.ack.due(played, finished)
                if ack is not None:
                    await self.send_ack(reply, ack)
                if finished and reply.ack.acked_ms >= reply.received_ms:
                    over.append(reply)
        if over:
            self.live_replies = [r for r in self.live_replies if r not in over]

    # ---- timing helpers ---------------------------------------------------------------------------
    def sent_at(self, ms: float) -> float | None:
        n = int(ms // self.run.chunk_ms)
        return self.sent_t[n] if 0 <= n < len(self.sent_t) else None

    def utterance_at(self, ms: float) -> Utterance | None:
        """The latest utterance starting at or before `ms` (allowing for prefix padding)."""
        for utterance in reversed(self.utterances):
            if utterance.start_ms - STARTED_BACK_MS <= ms:
                return utterance
        return None

    # ---- server events ----------------------------------------------------------------------------
    def on_event(self, event: events.ServerEvent, now: float) -> None:
        """One server event, as the calls below."""
        self.dispatch(event.member, event.data if event.member else None, now)  # type: ignore[attr-defined]

    def dispatch(self, kind: str, ev: Any, now: float) -> None:
        """An event by its ConverseResponse oneof member and payload."""
        if kind == "response_output_audio_delta":
            if ev.audio:
                channels = max(1, ev.channels)
                self.on_audio(ev.response_id, len(ev.audio) // (2 * channels), ev.sample_rate, now)
        elif kind == "input_audio_buffer_speech_started":
            self.on_judged(now)
            self.on_speech_started(ev.audio_start_ms, now)
        elif kind == "input_audio_buffer_speech_tentative":
            self.on_tentative(ev.response_id, now)
        elif kind == "input_audio_buffer_backchannel":
            self.on_judged(now)
        elif kind == "input_audio_buffer_speech_stopped":
            self.on_speech_stopped(ev.item_id, ev.audio_end_ms, now)
        elif kind == "conversation_item_input_audio_transcription_completed":
            self.on_transcript(ev.item_id, now)
        elif kind == "response_created":
            self.on_response_created(ev.response_id, now)
        elif kind == "response_done":
            self.stats.record_timings({f.name: v for f, v in ev.timings.ListFields()})
            self.on_response_done(ev.response_id, ev.status in (realtime_pb2.RESPONSE_STATUS_COMPLETED,
                                                                realtime_pb2.RESPONSE_STATUS_CANCELLED))
        elif kind == "output_audio_buffer_cleared":
            self.on_cleared(ev.response_id, now)
        elif kind == "error":
            self.on_error(ev.code, ev.message, ev.event_id)
        elif kind in ("session_created", "session_updated"):
            self.on_session(ev.session.turn_detection.silence_duration_ms)
        elif kind == "session_closed":
            self.closed_reason = ev.reason

    def on_speech_started(self, audio_start_ms: float, now: float) -> None:
        utterance = self.utterance_at(audio_start_ms)
        if utterance is not None and (audio_start_ms > utterance.end_ms or utterance.vad_seen):
            utterance = None  # started in the silence after it, or again inside it (not an onset)
        self.last_started = (now, utterance)
        if utterance is not None:
            utterance.vad_seen = True
            if (sent := self.sent_at(utterance.start_ms)) is not None:
                self.stats.record("vad_start_ms", now - sent, now)

    def on_tentative(self, response_id: str, now: float) -> None:
        """Voice over the reply is being judged: its playback holds, as a client that pauses on
        the event does (the rest of it is not yet heard, and more of it may still come)."""
        reply = self.live_reply(response_id)
        if reply is not None and not reply.cleared and reply.held_at is None:
            reply.held_at = now

    def on_judged(self, now: float) -> None:
        """The voice was judged: held replies play on from where they held."""
        for reply in self.live_replies:
            if reply.held_at is not None:
                reply.play_until = now + max(0.0, reply.play_until - reply.held_at)
                reply.held_at = None

    def on_speech_stopped(self, item_id: str, audio_end_ms: float, now: float) -> None:
        paused = self.utterance_at(audio_end_ms)
        if paused is not None and paused.resumes_ms is not None and audio_end_ms < paused.resumes_ms \
                and not paused.premature:
            paused.premature = True  # the turn ended while the user paused mid-sentence
            self.stats.premature_turn_ends += 1
        decision_ms = audio_end_ms + self.silence_ms
        utterance = self.utterance_at(decision_ms)
        voiced_t = None
        if utterance is not None and utterance.start_ms < decision_ms:
            voiced_t = self.sent_at(min(utterance.end_ms, decision_ms - 1))
        self.trigger = (now, voiced_t)
        if self.transcribes:
            self.stopped_at[item_id] = now

    def on_transcript(self, item_id: str, now: float) -> None:
        if (stopped := self.stopped_at.pop(item_id, None)) is not None:
            self.stats.record("transcript_final_ms", now - stopped, now)

    def on_response_created(self, response_id: str, now: float) -> None:
        trigger_t, voiced_t = self.trigger or (None, None)
        self.trigger, self.awaiting_since = None, None
        self.live_replies.append(Reply(response_id, now, trigger_t, voiced_t))
        self.stats.responses += 1

    def on_response_done(self, response_id: str, ok: bool) -> None:
        """`ok`: completed or cancelled; anything else counts as a response_failed error."""
        if (reply := self.live_reply(response_id)) is not None:
            reply.status = "done"
        if not ok:
            self.error("response_failed")

    def on_error(self, code: str, message: str, event_id: str) -> None:
        if event_id == CONFIG_ID:
            self.run.fail(f"the server rejected the session config: {message}")
        self.error(code)

    def on_session(self, silence_ms: int) -> None:
        """session.created or .updated: admitted, with its turn detection's silence window."""
        self.admitted = True
        self.opened.set()
        self.silence_ms = silence_ms or self.silence_ms

    def live_reply(self, response_id: str) -> Reply | None:
        return next((r for r in self.live_replies if r.response_id == response_id), None)

    def on_audio(self, response_id: str, frames: int, rate: int, now: float) -> Reply | None:
        """A reply audio delta of `frames` samples at `rate`; the reply it played into."""
        reply = self.live_reply(response_id)
        if reply is None or reply.cleared or frames <= 0 or rate <= 0:
            return None
        stats = self.stats
        seconds = frames / rate
        if reply.first_audio_t is None:
            reply.first_audio_t = reply.play_until = now
            if reply.trigger_t is not None:
                latency = now - reply.trigger_t
                self.latencies.append(latency * 1000)
                stats.record("response_latency_ms", latency, now)
            if reply.voiced_t is not None:
                stats.record("voice_to_voice_ms", now - reply.voiced_t, now)
            if self.barge_share and self.rng.random() < self.barge_share:
                self.barge_at = now + self.rng.uniform(*BARGE_AFTER_S)
        elif reply.held_at is None:
            if now > reply.play_until:
                self.underruns += 1
                stats.underruns += 1
            stats.record("jitter_ms", max(0.0, now - reply.last_t - reply.last_s), now)
        reply.received_frames += frames
        reply.received_ms = reply.received_frames * 1000 // rate
        reply.play_until = (max(now, reply.play_until) if reply.held_at is None else reply.play_until) + seconds
        reply.last_t, reply.last_s = now, seconds
        return reply

    def on_cleared(self, response_id: str, now: float) -> Reply | None:
        """The reply's playback stops here (a barge-in): the reply, unless it was already cut."""
        reply = self.live_reply(response_id)
        if reply is None or reply.cleared:
            return None
        reply.received_ms, reply.play_until, reply.cleared = reply.played_ms(now), now, True
        reply.held_at = None
        if reply.over:
            self.stats.cancelled[reply.over] += 1
        if reply.over in ("", "speech") and self.last_started is not None and self.last_started[0] >= reply.created_t:
            utterance = self.last_started[1]
            if utterance is not None and (sent := self.sent_at(utterance.start_ms)) is not None:
                self.stats.record("barge_in_ms", now - sent, now)
        return reply

    def summary(self) -> dict[str, Any]:
        latencies = sorted(self.latencies)
        return {"index": self.index, "profile": self.profile, "admitted": self.admitted,
                "closed_reason": self.closed_reason, "utterances": len(self.utterances),
                "response_latency_p50_ms": round(latencies[len(latencies) // 2], 1) if latencies else None,
                "responses": len(self.latencies), "errors": self.errors, "underruns": self.underruns}
