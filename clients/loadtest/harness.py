"""`rtmedia loadtest`: many simulated people talking to a server at once, measured
as docs/protocol.md#latency-definitions defines, over RealtimeService.Converse through the
generated stubs (--transport grpc) or over OpenAI's Realtime API on the web front's
`/v1/realtime` WebSocket (--transport openai-ws, rtmedia.clients.loadtest.openai_ws).

Each person is one session and two tasks: a sender that streams speech at real-time pace
(one append event per --chunk-ms, silence between utterances, as a live microphone does)
and acknowledges the reply it is "playing", and a reader that handles the server's events.
Replies are played on a simulated clock that starts with their first audio delta. The
transports differ only in how a person connects, what it sends and how it reads events;
what it measures is the same code, so both give the same report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rtmedia.clients import events
from rtmedia.clients.channels import CHANNEL_OPTIONS, DEFAULT_TARGET
from rtmedia.clients.commands import talk
from rtmedia.clients.commands.cli import CliError
from rtmedia.clients.credentials import (
    Credentials,
    add_credential_flags,
    from_args,
    status_refusal,
    token_of,
    unavailable_hint,
)
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.loadtest.report import (
    Stats,
    build_report,
    capacity,
    key_latency,
    next_level,
    render_table,
    slo_verdict,
    summary_lines,
    write_plot,
)
from rtmedia.clients.loadtest.speech import (
    Clip,
    audio_files,
    backchannel_clips,
    load_clips,
    noise_clips,
    paused_clips,
    synthesized,
)
from rtmedia.clients.session import RealtimeSession
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2

PROFILES = ("listen", "transcribe", "talk", "llm", "mixed", "barge-in")
TRANSPORTS = ("grpc", "openai-ws")
DEFAULT_WEB_URL = "http://127.0.0.1:8080"
MIXED = ("listen", "listen", "transcribe", "talk")  # mixed: sessions take these in turn
RESPONDERS = {"talk": "echo", "barge-in": "echo", "llm": "llm"}
INPUT_RATES = (8000, 16000, 24000)
DEFAULT_INPUT_RATE = 16000
API_INPUT_RATE = 24000  # openai-ws: the Realtime API's audio/pcm is PCM16 at 24 kHz
CONFIG_ID = "loadtest-config"
PAUSE_S = (1.0, 2.5)  # silence between utterances when nothing answers
GAP_S = (0.4, 1.2)  # after a reply has played, before speaking again
BARGE_AFTER_S = (0.4, 0.9)  # barge-in: interrupt this long after the reply's first audio
QUIET_S = 1.5  # at the end: this much silence after the last utterance, so its turn ends
ACK_EVERY_MS = 200
STARTED_BACK_MS = 700  # speech_started's audio_start_ms may lie this far before the voice (prefix padding)
SESSIONS_PER_CONNECTION = 50
CLOSE_WAIT_S = 10.0
SETTLE_S = 3.0  # between capacity levels, for the server to close the last level's sessions

DESCRIPTION = """\
Simulate many people talking to an rtmedia server at once and measure what they
experience. Each session streams real speech (Piper-synthesised sentences, or the
audio files of --audio DIR, any format, one utterance per file) at real-time pace in --chunk-ms
chunks with 1-2.5 s silences between utterances (talking profiles: the next
utterance follows 0.4-1.2 s after the reply has played), plays replies on a
simulated clock and (grpc) acknowledges them with playback.ack every 200 ms of play.

Profiles (session config):
  listen       server VAD turn events only: transcription off, no responses
  transcribe   plus streaming transcription of every turn
  talk         full turns answered by the echo responder (openai-ws: the server's default)
  llm          full turns answered by the llm responder (grpc only)
  mixed        sessions take listen, listen, transcribe, talk in turn
  barge-in     talk, interrupting --barge-in-share of the replies 0.4-0.9 s into them; of those
               voices, --backchannel-share are backchannels ("yeah", "mm-hmm") and --noise
               a burst like a cough or a knock, neither of which should cancel the reply
               (--interruption confirmed tells them apart; immediate, the server's default, does not)

Measured on the client's clock (docs/protocol.md#latency-definitions): response latency (speech_stopped
received -> first reply audio), voice-to-voice (last voiced sample sent -> first
reply audio), barge-in (first voiced sample of the interruption sent ->
output_audio_buffer.cleared), VAD start (first voiced sample sent ->
speech_started), final transcript (speech_stopped -> transcription .completed),
jitter (how much later than the previous delta's play time each reply audio
delta arrived) and underruns (a reply delta arriving after the audio before it
had finished playing). Percentiles are p50/p95/p99/max.

Transports: grpc (default) speaks RealtimeService.Converse to --target. openai-ws
speaks OpenAI's Realtime API (GA) to the web front (`rtmedia web`, `rtmedia serve
--web`) at --web-url (https:// for TLS, with --ca and --cert/--key): each session is
a WebSocket to /v1/realtime?model=gpt-realtime (with --token: Authorization: Bearer),
set up with session.update (audio/pcm, PCM16 at 24 kHz both ways; server_vad or no
turn detection; transcription where the profile transcribes) and fed
input_audio_buffer.append events of base64 PCM16 at 24 kHz (the speech resampled;
--input-rate may only be 24000); it ends by closing the socket. The API has no
playback.ack: the client only plays its replies on its clock, and the server
estimates each reply's playback from the wall clock since its first delta. A
barge-in is the client's own: at speech_started during a reply it stops playing it
and sends conversation.item.truncate with what it played; barge-in latency ends
there (or at output_audio_buffer.cleared or the reply's cancelled response.done,
if one comes first). A handshake refused with 429 counts as rejected. Replies come
from the server's default responder (run the server with --responder echo for talk
and barge-in); llm needs the llm responder chosen per session, which the API cannot
do, so it is grpc only. The report has the same fields plus "transport"; its
"target" is then the WebSocket URL.

--find-capacity runs levels of sessions (starting at --sessions, growing 1.5x,
then bisecting) until the SLO breaks: p95 of the profile's key latency (response
latency; VAD start for listen, final transcript for transcribe) within
--slo-p95-ms, no underruns, no errors, nobody rejected. It reports the largest
level that held.
"""


def add_loadtest_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="many simulated sessions at once: latency percentiles and capacity",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server gRPC address (default {DEFAULT_TARGET})")
    p.add_argument("--transport", choices=TRANSPORTS, default="grpc",
                   help="grpc (Converse, default) or openai-ws (OpenAI's Realtime API on --web-url's /v1/realtime)")
    p.add_argument("--web-url", default=DEFAULT_WEB_URL,
                   help=f"openai-ws: the web front's base URL, http:// or https:// (default {DEFAULT_WEB_URL})")
    p.add_argument("--sessions", type=int, default=10, help="concurrent sessions (default 10; the first "
                                                            "level with --find-capacity)")
    p.add_argument("--ramp-per-s", type=float, default=10.0, help="sessions started per second (default 10)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds from the first session's start until sessions stop speaking (default 30); "
                        "they then finish their turn and close")
    p.add_argument("--profile", choices=PROFILES, default="talk", help="what the sessions do (default talk)")
    p.add_argument("--chunk-ms", type=int, default=20, help="audio per append event, 10..1000 (default 20)")
    p.add_argument("--input-rate", type=int, default=None,
                   help="PCM16 input rate: 8000, 16000 (default), 24000; openai-ws: 24000 only (the default there)")
    p.add_argument("--turn-detection", choices=["server_vad", "semantic_vad", "none"], default="server_vad",
                   help="semantic_vad: a model decides at each pause whether the user has finished; none (listen "
                        "only) streams audio with no turn detection (the frame-path benchmark)")
    p.add_argument("--eagerness", choices=["low", "medium", "high", "auto"], default=None,
                   help="semantic_vad: how readily a pause ends the turn (default auto = medium)")
    p.add_argument("--paused-share", type=float, default=0.0,
                   help="the share of utterances spoken with a 600-900 ms pause where the sentence is plainly "
                        "unfinished (default 0); a turn that ends in such a pause counts as premature")
    p.add_argument("--barge-in-share", type=float, default=0.5,
                   help="barge-in: the share of replies interrupted (default 0.5)")
    p.add_argument("--interruption", choices=["immediate", "confirmed"], default=None,
                   help="turn_detection.interruption.mode (default: the server's, immediate)")
    p.add_argument("--preemptive", choices=["on", "off"], default=None,
                   help="turn_detection.preemptive: replies prepared at pauses (default: the server's, on)")
    p.add_argument("--backchannel-share", type=float, default=0.0,
                   help="barge-in: the share of the voices over replies that are backchannels (default 0)")
    p.add_argument("--noise", type=float, default=0.0, metavar="SHARE",
                   help="barge-in: the share of the voices over replies that are noise bursts (default 0)")
    p.add_argument("--audio", type=Path, default=None, metavar="DIR",
                   help="speak the audio files of DIR (wav, mp3, m4a, ogg/opus, flac, webm, ...: any format "
                        "PyAV decodes; other files are skipped) instead of the built-in sentences")
    p.add_argument("--seed", type=int, default=1, help="random seed for pauses and clip order (default 1)")
    p.add_argument("--reply-timeout", type=float, default=30.0,
                   help="seconds a turn may wait for its response before it counts as a no_response error")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to reach the server (default 5)")
    p.add_argument("--find-capacity", action="store_true", help="grow the session count until the SLO breaks")
    p.add_argument("--capacity-limit", type=int, default=2000, help="--find-capacity stops here (default 2000)")
    p.add_argument("--slo-p95-ms", type=float, default=500.0, help="SLO on the key latency's p95 (default 500)")
    p.add_argument("--fail-on-slo", action="store_true", help="exit non-zero when the SLO did not hold")
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart (latency and sessions over time)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout (the table goes to stderr)")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    add_credential_flags(p)
    p.set_defaults(func=cmd_loadtest)


def input_rate(args: argparse.Namespace) -> int:
    """The PCM16 rate the sessions stream: --input-rate, else the transport's default."""
    if args.input_rate is not None:
        return int(args.input_rate)
    return API_INPUT_RATE if args.transport == "openai-ws" else DEFAULT_INPUT_RATE


def check_args(args: argparse.Namespace) -> None:
    """Impossible parameters are one-line errors."""
    rate = input_rate(args)
    if args.transport == "openai-ws":
        from rtmedia.clients.loadtest.openai_ws import check_openai_args

        check_openai_args(args)
    problems = [
        (args.sessions < 1, f"--sessions must be at least 1, got {args.sessions}"),
        (args.ramp_per_s <= 0, f"--ramp-per-s must be positive, got {args.ramp_per_s:g}"),
        (args.duration <= 0, f"--duration must be positive, got {args.duration:g}"),
        (not 10 <= args.chunk_ms <= 1000, f"--chunk-ms must be 10..1000, got {args.chunk_ms}"),
        (rate not in INPUT_RATES, f"--input-rate must be one of {', '.join(map(str, INPUT_RATES))}, got {rate}"),
        (rate * args.chunk_ms % 1000 != 0, f"--chunk-ms {args.chunk_ms} is not a whole number of samples at {rate} Hz"),
        (not 0 <= args.barge_in_share <= 1, f"--barge-in-share must be 0..1, got {args.barge_in_share:g}"),
        (args.turn_detection == "none" and args.profile != "listen",
         "--turn-detection none is only for --profile listen"),
        (args.eagerness is not None and args.turn_detection != "semantic_vad",
         "--eagerness is for --turn-detection semantic_vad"),
        (not 0 <= args.paused_share <= 1, f"--paused-share must be 0..1, got {args.paused_share:g}"),
        (not 0 <= args.backchannel_share <= 1, f"--backchannel-share must be 0..1, got {args.backchannel_share:g}"),
        (not 0 <= args.noise <= 1, f"--noise must be 0..1, got {args.noise:g}"),
        (args.backchannel_share + args.noise > 1,
         f"--backchannel-share and --noise add up to {args.backchannel_share + args.noise:g}, more than 1"),
        ((args.backchannel_share or args.noise) and args.profile != "barge-in",
         "--backchannel-share and --noise are for --profile barge-in (they are said over replies)"),
        (args.interruption is not None and args.turn_detection == "none",
         "--interruption needs turn detection"),
        (args.preemptive is not None and args.turn_detection == "none",
         "--preemptive needs turn detection"),
        (args.paused_share > 0 and args.audio is not None, "--paused-share speaks built-in sentences, not --audio"),
        (args.slo_p95_ms <= 0, f"--slo-p95-ms must be positive, got {args.slo_p95_ms:g}"),
        (args.reply_timeout <= 0, f"--reply-timeout must be positive, got {args.reply_timeout:g}"),
        (args.connect_timeout <= 0, f"--connect-timeout must be positive, got {args.connect_timeout:g}"),
        (args.find_capacity and args.capacity_limit < args.sessions,
         f"--capacity-limit {args.capacity_limit} is below --sessions {args.sessions}"),
    ]
    for bad, message in problems:
        if bad:
            raise CliError(message)
    top = args.capacity_limit if args.find_capacity else args.sessions
    ramp_s = (top - 1) / args.ramp_per_s
    if ramp_s >= args.duration:
        raise CliError(f"starting {top} sessions at {args.ramp_per_s:g}/s takes {ramp_s:.1f} s, not less than "
                       f"--duration {args.duration:g} s: raise --ramp-per-s or --duration")


def session_config(profile: str, args: argparse.Namespace) -> dict[str, Any]:
    turn: dict[str, Any] = {"type": args.turn_detection}
    if args.turn_detection == "semantic_vad":
        turn["eagerness"] = args.eagerness
    if args.interruption:
        turn["interruption"] = {"mode": args.interruption}
    if args.preemptive is not None:
        turn["preemptive"] = args.preemptive == "on"
    if profile in ("listen", "transcribe") and args.turn_detection != "none":
        turn["create_response"] = False
    config: dict[str, Any] = {"input_audio_format": {"sample_rate": input_rate(args)},
                              "input_audio_transcription": {"enabled": profile != "listen"},
                              "turn_detection": turn}
    if profile in RESPONDERS:
        config["responder"] = RESPONDERS[profile]
    return config


# ---- one simulated person --------------------------------------------------------------------------

@dataclass
class Utterance:
    start_ms: float  # first and last voiced sample, in the session's input audio
    end_ms: float
    vad_seen: bool = False
    resumes_ms: float | None = None  # a paused sentence: where the voice resumes after the pause
    premature: bool = False  # a turn ended in its pause


@dataclass
class Reply(talk.Reply):
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
                if played - reply.acked_ms >= ACK_EVERY_MS or (finished and played > reply.acked_ms):
                    reply.acked_ms = played
                    await self.send_ack(reply, played)
                if finished and reply.acked_ms >= reply.received_ms:
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


# ---- one run at a fixed session count -----------------------------------------------------------------

@dataclass
class Run:
    """One level: `sessions` people at once. `link` is what they connect through: the gRPC
    channels, or (openai-ws) a rtmedia.clients.loadtest.openai_ws.SocketLink; `clips` hold
    that transport's append events."""

    args: argparse.Namespace
    link: Any
    clips: list[Clip]
    sessions: int
    stats: Stats = field(init=False)
    silence: Any = field(init=False)
    chunk_ms: int = field(init=False)
    configs: dict[str, dict[str, Any]] = field(init=False)
    person: type[Person] = field(init=False)
    stop_at: float = 0.0
    drain_at: float = 0.0
    failure: str = ""
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.chunk_ms = self.args.chunk_ms
        self.stats = Stats(time.perf_counter())
        self.plain = [c for c in self.clips if c.kind == "speech" and c.pause_ms is None]
        self.paused = [c for c in self.clips if c.pause_ms is not None]  # --paused-share
        self.backchannels = [c for c in self.clips if c.kind == "backchannel"]  # --backchannel-share
        self.noises = [c for c in self.clips if c.kind == "noise"]  # --noise
        silence = bytes(2 * input_rate(self.args) * self.chunk_ms // 1000)
        profiles = [p for p in PROFILES if p != "mixed"]
        if self.args.transport == "openai-ws":
            from rtmedia.clients.loadtest.openai_ws import SocketPerson, api_session, append_event

            self.person, self.silence = SocketPerson, append_event(silence)
            self.configs = {p: api_session(p, self.args) for p in profiles}
        else:
            self.person, self.silence = Person, client_event("input_audio_buffer.append", audio=silence)
            self.configs = {p: session_config(p, self.args) for p in profiles}

    @property
    def where(self) -> str:
        """Where the sessions go: the gRPC target or the WebSocket URL."""
        return str(self.link.url) if self.args.transport == "openai-ws" else str(self.args.target)

    def channel_for(self, index: int) -> grpc.aio.Channel:
        return self.link[index % len(self.link)]

    def fail(self, message: str) -> None:
        if not self.failure:
            self.failure = message
            self.failed.set()

    def profile_of(self, index: int) -> str:
        return MIXED[index % len(MIXED)] if self.args.profile == "mixed" else self.args.profile

    async def go(self, progress: Progress) -> dict[str, Any]:
        args = self.args
        cpu0, origin = _cpu_s(), time.perf_counter()
        self.stats.origin = origin
        self.stop_at = origin + args.duration
        self.drain_at = self.stop_at + max(15.0, args.reply_timeout)
        people = [self.person(self, n, self.profile_of(n)) for n in range(self.sessions)]
        tasks = [asyncio.create_task(p.live(origin + n / args.ramp_per_s), name=f"loadtest-{n}")
                 for n, p in enumerate(people)]
        everyone = asyncio.gather(*tasks)
        failed = asyncio.create_task(self.failed.wait())
        ticker = asyncio.create_task(progress.follow(self), name="loadtest-progress")
        try:
            await asyncio.wait([everyone, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*tasks, failed, ticker):
                task.cancel()
            await asyncio.gather(everyone, failed, ticker, return_exceptions=True)
        if self.failure:
            raise CliError(self.failure)
        await everyone  # a bug in a person surfaces here
        self.stats.tick(time.perf_counter())
        settings = {"profile": args.profile, "sessions": self.sessions, "ramp_per_s": args.ramp_per_s,
                    "duration_s": args.duration, "chunk_ms": self.chunk_ms, "input_rate": input_rate(args),
                    "turn_detection": args.turn_detection, "interruption": args.interruption or "server default",
                    "transport": args.transport, "target": self.where,
                    "audio": str(args.audio) if args.audio else "built-in Piper sentences"}
        report = build_report(self.stats, settings, time.perf_counter() - origin, _cpu_s() - cpu0,
                              os.cpu_count() or 1, [p.summary() for p in people])
        held, verdict = slo_verdict(report, args.slo_p95_ms)
        report["slo"] = {"metric": key_latency(args.profile), "p95_ms": args.slo_p95_ms, "held": held,
                         "verdict": verdict}
        return report


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Progress:
    """Live progress: a rich table on a terminal, else a line every 5 s on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.label = ""

    async def follow(self, run: Run) -> None:
        live = None
        if not self.quiet and self.tty:
            from rich.console import Console
            from rich.live import Live

            live = Live(console=Console(stderr=True), refresh_per_second=2, transient=True)
            live.start()
        try:
            n = 0
            while True:
                await asyncio.sleep(1.0)
                point = run.stats.tick(time.perf_counter())
                n += 1
                if live is not None:
                    live.update(self.table(point, run))
                elif not self.quiet and n % 5 == 0:
                    print(self.line(point, run), file=sys.stderr, flush=True)
        finally:
            if live is not None:
                live.stop()

    def line(self, point: dict[str, Any], run: Run) -> str:
        def ms(metric: str) -> str:
            return "-" if point[metric]["p95"] is None else f"{point[metric]['p95']:.0f}"

        return (f"{self.label}t={point['t_s']:.0f}s active {point['active']}/{run.sessions} "
                f"rejected {point['rejected']} errors {point['errors']} underruns {point['underruns']} "
                f"p95 ms (last 5 s): response {ms('response_latency_ms')} vad {ms('vad_start_ms')} "
                f"transcript {ms('transcript_final_ms')}")

    def table(self, point: dict[str, Any], run: Run) -> Any:
        from rich.table import Table

        table = Table(title=f"{self.label}rtmedia loadtest: {run.args.profile} at {run.where}, "
                            f"{point['t_s']:.0f} s", title_justify="left")
        for col in ("active", "started", "rejected", "errors", "underruns", "late chunks"):
            table.add_column(col, justify="right")
        table.add_row(f"{point['active']}/{run.sessions}", str(point["started"]), str(point["rejected"]),
                      str(point["errors"]), str(point["underruns"]), str(run.stats.late_chunks))
        lat = Table(title="last 5 s (ms)", title_justify="left")
        for col in ("latency", "p50", "p95"):
            lat.add_column(col, justify="right")
        for metric in ("response_latency_ms", "vad_start_ms", "transcript_final_ms"):
            s = point[metric]
            lat.add_row(metric.removesuffix("_ms"), *("-" if s[q] is None else f"{s[q]:.0f}" for q in ("p50", "p95")))
        from rich.console import Group

        return Group(table, lat)


# ---- the command ------------------------------------------------------------------------------------

async def _connect(args: argparse.Namespace, sessions: int, credentials: Credentials) -> list[grpc.aio.Channel]:
    """Channels (one connection per 50 sessions, like separate users) to a server that is SERVING."""
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]

    def channel() -> grpc.aio.Channel:
        return credentials.aio_channel(args.target, options)

    first = channel()
    try:
        reply = await health_pb2_grpc.HealthStub(first).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=args.connect_timeout)
    except grpc.aio.AioRpcError as exc:
        await first.close()
        tls = credentials.describe()
        detail = (exc.details() or "").splitlines()[0] if exc.details() else exc.code().name
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            detail = f"no answer within {args.connect_timeout:g} s"
        raise CliError(f"cannot reach {args.target} ({tls}): {detail}; check the address and whether the server "
                       f"uses TLS (--tls){unavailable_hint(args, detail) if credentials.tls else ''}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        await first.close()
        raise CliError(f"{args.target} is not serving (health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)})")
    return [first, *(channel() for _ in range(-(-sessions // SESSIONS_PER_CONNECTION) - 1))]


async def _open(args: argparse.Namespace, sessions: int, credentials: Credentials) -> Any:
    """The transport's link to a server that answers: gRPC channels, or a SocketLink."""
    if args.transport == "openai-ws":
        from rtmedia.clients.loadtest.openai_ws import open_link

        return await open_link(args, credentials)
    return await _connect(args, sessions, credentials)


async def _close(args: argparse.Namespace, link: Any) -> None:
    if args.transport == "openai-ws":
        await link.close()
        return
    for channel in link:
        await channel.close()


async def _loadtest(args: argparse.Namespace, clips: list[Clip], credentials: Credentials) -> dict[str, Any]:
    top = args.capacity_limit if args.find_capacity else args.sessions
    link = await _open(args, top, credentials)
    progress = Progress(args.quiet)
    try:
        if not args.find_capacity:
            return await Run(args, link, clips, args.sessions).go(progress)
        results: dict[int, bool] = {}
        levels: list[dict[str, Any]] = []
        best: dict[str, Any] | None = None
        level = next_level(results, args.sessions, 1.5, 0.1, args.capacity_limit)
        while level is not None:
            progress.label = f"[{level} sessions] "
            report = await Run(args, link, clips, level).go(progress)
            held = report["slo"]["held"]
            results[level] = held
            metric = report["slo"]["metric"]
            levels.append({"sessions": level, "held": held, "verdict": report["slo"]["verdict"],
                           f"{metric}_p95": report[metric]["p95"], "errors": report["errors"],
                           "underruns": report["underruns"], "rejected": report["sessions_rejected"],
                           "loadgen_cpu_share": report["loadgen_cpu_share"]})
            if not args.quiet:
                print(f"{level} sessions: {report['slo']['verdict']}", file=sys.stderr, flush=True)
            if held and (best is None or level > best["sessions"]):
                best = report
            level = next_level(results, args.sessions, 1.5, 0.1, args.capacity_limit)
            if level is not None:
                await asyncio.sleep(SETTLE_S)
        final = best if best is not None else report
        final["capacity"] = capacity(results)
        final["capacity_levels"] = levels
        return final
    finally:
        await _close(args, link)


def cmd_loadtest(args: argparse.Namespace) -> None:
    check_args(args)
    credentials = from_args(args)
    paths = audio_files(args.audio) if args.audio else synthesized()
    clips = load_clips(paths, input_rate(args), args.chunk_ms)
    if args.paused_share:
        clips += paused_clips(input_rate(args), args.chunk_ms, args.seed)
    if args.backchannel_share:
        clips += backchannel_clips(input_rate(args), args.chunk_ms)
    if args.noise:
        clips += noise_clips(input_rate(args), args.chunk_ms, args.seed)
    if args.transport == "openai-ws":
        from rtmedia.clients.loadtest.openai_ws import socket_clips

        clips = socket_clips(clips)
    report = asyncio.run(_loadtest(args, clips, credentials))
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        write_plot(report, args.plot)
    from rich.console import Console

    console = Console(stderr=args.json)
    console.print(render_table(report))
    for line in summary_lines(report):
        console.print(line, highlight=False)
    if "capacity" in report:
        console.print(f"capacity: {report['capacity']} sessions held the SLO", highlight=False)
    if args.json:
        print(json.dumps(report), flush=True)
    if args.fail_on_slo and not report["slo"]["held"]:
        raise CliError(f"the SLO did not hold: {report['slo']['verdict']}")
