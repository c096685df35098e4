"""One `rtmedia talk` session, whatever feeds it (a file: rtmedia.clients.commands.talk; the
microphone: talk_mic): the input audio as chunks, the replies "played" on a simulated clock that
sends `playback.ack` as a real client would, the `Talk` state that reads the server's events and
measures latencies (docs/protocol.md#latency-definitions, as the client sees them), `converse`,
which runs it on a RealtimeSession, and the end of a run: the `-o` file, `--record`, the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.clients.audio_file import STDIO, AudioWriter, output_format, read_audio
from rtmedia.clients.commands.common import CliError
from rtmedia.clients.commands.talk_recording import TalkRecording
from rtmedia.clients.credentials import Credentials
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.session import RealtimeSession
from rtmedia.clients.tools import Toolbox, ToolError, load_tools
from rtmedia.protocol.events import client_event, event_type, to_json
from rtmedia.protocol.playback import PlaybackAck
from rtmedia.protocol.turn_kinds import MANUAL, SEMANTIC_VAD, VAD_TURNS
from rtmedia.v1 import realtime_pb2

INPUT_RATES = (8000, 16000, 24000)  # PCM16 rates a session takes; others are resampled to 24 kHz
RESAMPLE_TO = 24000
VOICED_DBFS = -45.0  # a chunk is voiced when its RMS is above this
MAX_SPEEDUP = 10  # without --realtime: at most 10x real time (the server's inbox holds 2 s)
QUIET_S = 1.5  # idle: no speech_started for this long after the last chunk
ACK_TICK_S = 0.02
ONSET_BACK_MS = 500  # how far before the VAD's speech start the energy onset may lie
ONSET_AHEAD_MS = 300  # ... or after it, when the VAD fired on quiet audio
CLOSE_WAIT_S = 10.0  # after session.close, how long the server has to end the stream
CONFIG_ID, COMMIT_ID, CREATE_ID = "talk-config", "talk-commit", "talk-response-create"


# ---- the input file ---------------------------------------------------------------------------

@dataclass
class InputAudio:
    rate: int
    source_rate: int
    chunks: list[bytes]
    starts_ms: list[float]  # offset of each chunk in the session's input audio
    voiced: list[bool]
    chunk_ms: float

    @property
    def seconds(self) -> float:
        return sum(len(c) for c in self.chunks) / 2 / self.rate

    def chunk_at(self, ms: float) -> int:
        return min(len(self.starts_ms) - 1, max(0, int(ms // self.chunk_ms)))


def load_input(path: Path, chunk_ms: int, tail_ms: int = 0, raw_rate: int | None = None) -> InputAudio:
    """The file (any audio PyAV decodes; STDIO: standard input, raw PCM16 at `raw_rate` when given)
    as chunks, plus `tail_ms` of silence after it (as a live microphone would keep sending, so
    that a file ending right after speech still ends its turn)."""
    if not 1 <= chunk_ms <= 1000:
        raise CliError(f"--chunk-ms must be 1..1000, got {chunk_ms}")
    audio = read_audio(path, raw_rate=raw_rate)
    if audio.sample_rate not in INPUT_RATES:
        audio = audio.at_rate(RESAMPLE_TO)
    samples, rate = audio.samples, audio.sample_rate
    if not len(samples):
        raise CliError(f"{path}: the file holds no audio")
    samples = np.concatenate([samples, np.zeros(rate * tail_ms // 1000, samples.dtype)])
    step = max(1, rate * chunk_ms // 1000)
    chunks, voiced = [], []
    for offset in range(0, len(samples), step):
        chunk = samples[offset:offset + step]
        rms = math.sqrt(float(np.mean(chunk.astype(np.float64) ** 2))) / 32768
        voiced.append(rms > 0 and 20 * math.log10(rms) > VOICED_DBFS)
        chunks.append(chunk.astype("<i2").tobytes())
    step_ms = step * 1000 / rate
    return InputAudio(rate, audio.sample_rate, chunks, [n * step_ms for n in range(len(chunks))], voiced, step_ms)


# ---- session state --------------------------------------------------------------------------------

STAGES = (("turn_detection_ms", "turn detection"), ("transcription_ms", "transcript"),
          ("first_text_ms", "first text"), ("first_audio_ms", "first audio"))


def stages(timings: realtime_pb2.ResponseTimings) -> str:
    """A response's timings (the server's clock) as one line."""
    parts = [f"{label} {getattr(timings, name)} ms" for name, label in STAGES if timings.HasField(name)]
    preemptive = ", prepared at the pause" if timings.preemptive == "committed" else ""
    return f"{', '.join(parts)}; voice-to-voice {timings.voice_to_voice_ms} ms (server){preemptive}"


@dataclass
class Reply:
    response_id: str
    created_t: float
    trigger_t: float | None  # speech_stopped received, or commit / response.create sent
    voiced_t: float | None  # send time of the turn's last voiced chunk
    first_audio_t: float | None = None
    status: str = ""  # from response.done
    text: str = ""  # text deltas so far
    # Simulated playback: a player that starts with the first delta and plays
    # whatever it has at real time. received_ms is whole ms of all frames so far,
    # as the server counts what it sent (played_ms may not exceed that, and the
    # last ack must reach it or the server takes the reply as still playing).
    received_frames: int = 0
    received_ms: int = 0
    play_until: float = 0.0
    ack: PlaybackAck = field(default_factory=PlaybackAck)
    cleared: bool = False

    def add_received(self, frames: int, rate: int) -> None:
        self.received_frames += frames
        self.received_ms = self.received_frames * 1000 // rate

    def played_ms(self, now: float) -> int:
        if self.first_audio_t is None:
            return 0
        return max(0, int(self.received_ms - max(0.0, self.play_until - now) * 1000))

    def playing(self, now: float) -> bool:
        return self.first_audio_t is not None and not self.cleared and now < self.play_until

    def latency_ms(self, since: float | None) -> float | None:
        if since is None or self.first_audio_t is None:
            return None
        return round((self.first_audio_t - since) * 1000, 1)


@dataclass
class Talk:
    args: argparse.Namespace
    audio: InputAudio
    session: Any = None  # the RealtimeSession
    origin: float | None = None  # perf_counter when the first chunk was sent
    sent_t: list[float] = field(default_factory=list)  # send time of each chunk
    last_chunk_t: float | None = None
    session_id: str = ""
    config: realtime_pb2.SessionConfig | None = None
    created: asyncio.Event = field(default_factory=asyncio.Event)  # session.created came
    configured: asyncio.Event = field(default_factory=asyncio.Event)
    config_error: str = ""
    replies: dict[str, Reply] = field(default_factory=dict)
    turn_floor_ms: float = 0.0  # end of the previous turn in the input audio
    trigger: tuple[float, float | None] | None = None  # (trigger_t, voiced_t) for the next response
    create_pending: bool = False
    last_started: tuple[float, int] | None = None  # (received, audio_start_ms)
    open_turn: bool = False
    partial: dict[str, str] = field(default_factory=dict)
    transcripts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    barge_in_ms: list[float] = field(default_factory=list)
    audio_parts: list[bytes] = field(default_factory=list)
    audio_rate: int = 0
    rate_change: str = ""
    closed_reason: str = ""
    timed_out: bool = False
    waiting_for: str = ""
    close_cancelled: bool = False
    closing: bool = False
    failure: Exception | None = None
    early: list[tuple[dict[str, Any], float]] = field(default_factory=list)  # JSON lines before the origin
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    toolbox: Toolbox | None = None
    recording: TalkRecording | None = None  # --record
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # name, arguments, output of each run
    tool_tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # ---- output helpers ---------------------------------------------------------
    def t(self, now: float) -> float:
        return now - (self.origin if self.origin is not None else now)

    @property
    def text_out(self) -> Any:
        """Where the text goes: stdout, unless the reply audio does (-o -)."""
        return sys.stderr if str(self.args.output) == STDIO else sys.stdout

    def say(self, now: float, text: str) -> None:
        if self.args.json:
            return
        clear = "\r\033[K" if sys.stderr.isatty() else ""
        print(f"{clear}[{self.t(now):5.2f} s] {text}", flush=True, file=self.text_out)

    def emit(self, msg: realtime_pb2.ConverseResponse, now: float) -> None:
        if msg.WhichOneof("event") == "response_output_audio_delta":
            size = len(msg.response_output_audio_delta.audio)
            light = realtime_pb2.ConverseResponse()
            light.CopyFrom(msg)
            light.response_output_audio_delta.audio = b""
            obj = {("audio_bytes" if k == "audio" else k): (size if k == "audio" else v)
                   for k, v in to_json(light).items()}
        else:
            obj = to_json(msg)
        if self.origin is None:
            self.early.append((obj, now))
        else:
            self._print_json(obj, now)

    def _print_json(self, obj: dict[str, Any], now: float) -> None:
        assert self.origin is not None
        obj["t_ms"] = round((now - self.origin) * 1000, 1)
        print(json.dumps(obj, ensure_ascii=False), flush=True, file=self.text_out)

    def flush_early(self) -> None:
        if self.origin is None and self.early:
            self.origin = self.early[-1][1]  # no audio was sent: count from the last early event
        for obj, now in self.early:
            self._print_json(obj, now)
        self.early.clear()

    # ---- sending ----------------------------------------------------------------------
    async def write(self, name: str, **fields: Any) -> None:
        async with self.write_lock:
            if not self.closing:  # nothing goes after session.close
                await self.session.send(client_event(name, **fields))

    async def drive(self) -> None:
        """Configure, stream the file, end the turn (manual/none), wait for idle, close.
        A failure that is not the RPC's own (the read side reports those) cancels the call."""
        try:
            await self._drive()
        except (asyncio.CancelledError, RtmediaError):
            raise
        except Exception as exc:
            if not self.session.call.done():
                self.failure = exc
                self.session.cancel_stream()

    def session_config(self, input_rate: int, mode: str, output_rate: int) -> dict[str, Any]:
        """The session.update of this talk: its voice's rate, turn mode, responder and tools."""
        args = self.args
        session: dict[str, Any] = {
            "input_audio_format": {"encoding": "pcm16", "sample_rate": input_rate, "channels": 1},
            "turn_detection": {"type": mode, "eagerness": args.eagerness,
                               "interruption": {"mode": args.interruption} if args.interruption else None,
                               "preemptive": None if args.preemptive is None else args.preemptive == "on"},
            "responder": args.responder, "instructions": args.instructions, "voice": args.voice,
            "output_sample_rate": output_rate,
        }
        if args.noise_reduction is not None:
            session["noise_reduction"] = {"type": "" if args.noise_reduction == "off" else args.noise_reduction}
        if self.toolbox is not None:
            session["tools"] = {"functions": self.toolbox.declarations}
        return session

    async def _drive(self) -> None:
        args, audio = self.args, self.audio
        session = self.session_config(audio.rate, args.mode, args.output_rate)
        # Nothing is written before the server admits the session: a refusal (at capacity, over a
        # quota) then never races a write, which gRPC would report as INTERNAL instead.
        await self.created.wait()
        await self.write("session.update", event_id=CONFIG_ID, session=session)
        await self.configured.wait()
        if not self.config_error:
            await self.stream_file()
            if args.mode not in VAD_TURNS:
                voiced_t = self.last_voiced_t(self.turn_floor_ms, math.inf)
                self.turn_floor_ms = audio.starts_ms[-1] + audio.chunk_ms
                self.create_pending = True
                self.trigger = (time.perf_counter(), voiced_t)  # set before the server can answer
                if args.mode == MANUAL:
                    await self.write("input_audio_buffer.commit", event_id=COMMIT_ID)
                await self.write("response.create", event_id=CREATE_ID)
            await self.wait_idle()
        await self.close_session()

    async def close_session(self) -> None:
        """session.close, then half-close; cancel the call if the server does not end it in time."""
        async with self.write_lock:
            self.closing = True
            await self.session.send(client_event("session.close", reason="client"))
            await self.session.end_input()
        await asyncio.sleep(CLOSE_WAIT_S)
        self.close_cancelled = True  # the server did not end the stream
        self.session.cancel_stream()

    async def stream_file(self) -> None:
        audio = self.audio
        speed = 1 if self.args.realtime else MAX_SPEEDUP
        start = time.perf_counter()
        for chunk, start_ms in zip(audio.chunks, audio.starts_ms, strict=True):
            delay = start + start_ms / 1000 / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with self.write_lock:
                sent = time.perf_counter()
                if self.origin is None:
                    self.origin = sent
                    self.flush_early()
                self.sent_t.append(sent)
                await self.session.send(client_event("input_audio_buffer.append", audio=chunk))
                if self.recording is not None:
                    self.recording.sent(chunk, audio.rate, sent)
            self.last_chunk_t = sent

    def idle(self, now: float) -> bool:
        if self.create_pending or self.last_chunk_t is None or self.tool_tasks:
            return False
        for reply in self.replies.values():
            if not reply.status or reply.playing(now) or (not reply.cleared and reply.played_ms(now) > reply.ack.acked_ms):
                return False
        quiet_from = max(self.last_chunk_t, self.last_started[0] if self.last_started else 0.0)
        return now - quiet_from >= QUIET_S

    async def wait_idle(self) -> None:
        deadline = time.perf_counter() + self.args.timeout
        while not self.idle(now := time.perf_counter()):
            if now >= deadline:
                self.timed_out = True
                busy = sum(1 for r in self.replies.values() if not r.status)
                playing = sum(1 for r in self.replies.values() if r.status and r.playing(now))
                self.waiting_for = ", ".join(
                    [f"{busy} response{'s' if busy != 1 else ''} in progress"] * bool(busy)
                    + ["an answer to response.create"] * self.create_pending
                    + [f"{playing} reply still playing"] * bool(playing)) or "quiet input"
                return
            await asyncio.sleep(0.05)

    async def ack_loop(self) -> None:
        """playback.ack every ~200 ms of simulated play time, and when a reply has played out."""
        while True:
            await asyncio.sleep(ACK_TICK_S)
            now = time.perf_counter()
            for reply in list(self.replies.values()):
                if self.closing:
                    return
                if reply.cleared or reply.first_audio_t is None:
                    continue
                played = reply.played_ms(now)
                finished = bool(reply.status) and not reply.playing(now)
                ack = reply.ack.due(played, finished)
                if ack is not None:
                    await self.write("playback.ack", response_id=reply.response_id, played_ms=ack)

    # ---- turn bookkeeping ---------------------------------------------------------------------
    def decision_ms(self, ev: Any) -> float:
        """Where in the input the server decided the turn was over: the silence it waits after the
        speech (silence_duration_ms, max_wait_ms), or for a semantic end, at most the audio sent
        by the time speech_stopped came."""
        turn = self.config.turn_detection if self.config else None
        if ev.reason == realtime_pb2.TURN_END_REASON_SEMANTIC and self.sent_t:
            return self.audio.starts_ms[len(self.sent_t) - 1] + self.audio.chunk_ms
        if turn is not None and ev.reason == realtime_pb2.TURN_END_REASON_MAX_WAIT:
            return ev.audio_end_ms + turn.max_wait_ms
        return ev.audio_end_ms + (turn.silence_duration_ms if turn is not None else 500)

    def last_voiced_t(self, from_ms: float, to_ms: float) -> float | None:
        """Send time of the last voiced chunk starting in [from_ms, to_ms)."""
        audio = self.audio
        for n in range(len(self.sent_t) - 1, -1, -1):
            if from_ms <= audio.starts_ms[n] < to_ms and audio.voiced[n]:
                return self.sent_t[n]
        return None

    def onset_t(self, start_ms: int) -> float | None:
        """Send time of the first voiced chunk of the speech the VAD saw start at start_ms."""
        audio, voiced = self.audio, self.audio.voiced
        n = audio.chunk_at(start_ms)
        if not voiced[n]:
            ahead = [k for k in range(n, min(len(voiced), audio.chunk_at(start_ms + ONSET_AHEAD_MS) + 1)) if voiced[k]]
            if not ahead:
                return self.sent_t[n] if n < len(self.sent_t) else None
            n = ahead[0]
        floor = audio.chunk_at(start_ms - ONSET_BACK_MS)
        while n > floor and voiced[n - 1]:
            n -= 1
        return self.sent_t[n] if n < len(self.sent_t) else None

    # ---- server events --------------------------------------------------------------------------
    def on_event(self, msg: realtime_pb2.ConverseResponse, now: float) -> None:
        if self.args.json:
            self.emit(msg, now)
        name = event_type(msg)
        ev = getattr(msg, msg.WhichOneof("event")) if name else None
        if name == "session.created":
            self.session_id, self.config = ev.session_id, ev.session
            self.created.set()
        elif name == "session.updated":
            self.config = ev.session
            if not self.configured.is_set():
                self.configured.set()
                self.describe_config(ev.session)
        elif name == "error":
            self.on_error(ev, now)
        elif name == "input_audio_buffer.speech_started":
            self.last_started, self.open_turn = (now, ev.audio_start_ms), True
        elif name == "input_audio_buffer.speech_tentative":
            self.say(now, "(voice over the reply: paused)")
        elif name == "input_audio_buffer.backchannel":
            self.say(now, f"(not an interruption: {ev.transcript or 'no words'}; the reply goes on)")
        elif name == "input_audio_buffer.speech_stopped":
            self.open_turn = False
            decision_ms = self.decision_ms(ev)
            if self.args.mode == SEMANTIC_VAD:
                reason = realtime_pb2.TurnEndReason.Name(ev.reason).removeprefix("TURN_END_REASON_").lower()
                score = f" (score {ev.score:.2f})" if ev.HasField("score") else ""
                self.say(now, f"end of turn: {reason}{score}")
            self.trigger = (now, self.last_voiced_t(self.turn_floor_ms, decision_ms))
            self.turn_floor_ms = decision_ms
        elif name == "conversation.item.input_audio_transcription.delta":
            self.partial[ev.item_id] = self.partial.get(ev.item_id, "") + ev.delta
            self.show_partial(self.partial[ev.item_id])
        elif name == "conversation.item.input_audio_transcription.completed":
            self.transcripts.append(ev.transcript)
            self.say(now, f"you: {ev.transcript or '(nothing recognised)'}")
        elif name == "response.created":
            trigger_t, voiced_t = self.trigger or (None, None)
            self.trigger, self.create_pending = None, False
            self.replies[ev.response_id] = Reply(ev.response_id, now, trigger_t, voiced_t)
        elif name == "response.output_audio.delta":
            self.on_audio(ev, now)
        elif name == "response.output_text.delta" and ev.response_id in self.replies:
            self.replies[ev.response_id].text += ev.delta
        elif name == "response.output_text.done" and ev.response_id in self.replies:
            reply = self.replies[ev.response_id]
            reply.text = ev.text
            self.say(now, f"rtmedia: {ev.text}{self.latency_note(reply)}")
        elif name == "response.done" and ev.response_id in self.replies:
            reply = self.replies[ev.response_id]
            if ev.function_calls and self.toolbox is not None:
                task = asyncio.create_task(self.run_calls(list(ev.function_calls)), name="talk-tools")
                self.tool_tasks.add(task)
                task.add_done_callback(self.tool_tasks.discard)
            reply.status = realtime_pb2.ResponseStatus.Name(ev.status).removeprefix("RESPONSE_STATUS_").lower()
            if reply.status == "cancelled":
                heard = f" after {self.heard_ms(reply, now) / 1000:.2f} s" if reply.first_audio_t else ""
                self.say(now, f"rtmedia (interrupted{heard}, {ev.status_reason}): "
                              f"{reply.text + '…' if reply.text else '(nothing yet)'}")
            elif reply.status == "incomplete":  # the token limit ended the reply
                self.say(now, f"rtmedia (cut at max_output_tokens): {reply.text}…")
            elif reply.status != "completed":
                self.say(now, f"! response {ev.response_id} {reply.status}: {ev.status_reason}")
            if ev.timings.HasField("voice_to_voice_ms"):
                self.say(now, f"  stages: {stages(ev.timings)}")
        elif name == "output_audio_buffer.cleared":
            self.on_cleared(ev, now)
        elif name == "session.closed":
            self.closed_reason = ev.reason

    def heard_ms(self, reply: Reply, now: float) -> int:
        """How much of the reply has played."""
        return reply.played_ms(now)

    def show_partial(self, text: str) -> None:
        if sys.stderr.isatty() and not self.args.json:
            print(f"\r\033[K  … {text}", end="", file=sys.stderr, flush=True)

    async def run_calls(self, calls: list[realtime_pb2.ConversationItem]) -> None:
        """Run a response's function calls here, send their outputs, and ask for the answer."""
        assert self.toolbox is not None
        for call in calls:
            self.say(time.perf_counter(), f"call {call.name}({call.arguments})")
            output = await self.toolbox.run(call.name, call.arguments)
            self.say(time.perf_counter(), f"  -> {output}")
            self.tool_calls.append({"name": call.name, "arguments": call.arguments, "output": output})
            await self.write("conversation.item.create", item={"type": "function_call_output", "call_id": call.call_id,
                                                               "output": output})
        self.create_pending = True
        self.trigger = (time.perf_counter(), None)
        await self.write("response.create", event_id=CREATE_ID)

    def describe_config(self, config: realtime_pb2.SessionConfig) -> None:
        if self.args.json:
            return
        out = f"{config.output_sample_rate} Hz" if config.output_sample_rate else "the voice's rate"
        print(f"session {self.session_id}: {self.args.input} ({self.audio.seconds:.2f} s at {self.audio.rate} Hz"
              f"{', resampled' if self.audio.rate != self.audio.source_rate else ''}), "
              f"{self.args.mode}, responder {config.responder or '(default)'}, voice {config.voice or '(default)'} "
              f"at {out}", file=sys.stderr, flush=True)

    def on_error(self, ev: Any, now: float) -> None:
        self.errors.append(ev.code)
        if ev.event_id == CONFIG_ID and not self.configured.is_set():
            self.config_error = ev.message  # the command's error message
            self.configured.set()
            return
        if ev.event_id == CREATE_ID:
            self.create_pending = False
        self.say(now, f"! error {ev.code}: {ev.message}")

    def note_rate(self, rate: int) -> None:
        """The replies' audio rate: the first one's, and a note if a later one differs (-o cannot hold both)."""
        if not self.audio_rate:
            self.audio_rate = rate
        elif rate != self.audio_rate and not self.rate_change:
            self.rate_change = f"reply audio changed rate from {self.audio_rate} to {rate} Hz"

    def on_audio(self, ev: Any, now: float) -> None:
        reply = self.replies.get(ev.response_id)
        if reply is None or not ev.audio:
            return
        self.note_rate(ev.sample_rate)
        self.audio_parts.append(ev.audio)
        if reply.first_audio_t is None:
            reply.first_audio_t = reply.play_until = now
        if not reply.cleared:
            if self.recording is not None:
                self.recording.played(ev.response_id, ev.audio, ev.sample_rate, now)
            frames = len(ev.audio) // (2 * max(1, ev.channels))
            reply.add_received(frames, ev.sample_rate)
            reply.play_until = max(now, reply.play_until) + frames / ev.sample_rate

    def on_cleared(self, ev: Any, now: float) -> None:
        reply = self.replies.get(ev.response_id)
        if reply is None:
            return
        heard_ms = reply.played_ms(now)
        reply.received_ms, reply.play_until, reply.cleared = heard_ms, now, True
        if self.recording is not None:
            self.recording.cleared(ev.response_id, now)
        what, note = "reply cleared", ""
        if self.last_started is not None and self.last_started[0] >= reply.created_t:
            what = "barge-in"
            onset = self.onset_t(self.last_started[1])
            if onset is not None:
                self.barge_in_ms.append(round((now - onset) * 1000, 1))
                note = f" (barge-in {self.barge_in_ms[-1]:.0f} ms)"
        self.say(now, f"~ {what}: reply {ev.response_id} cut after {heard_ms / 1000:.2f} s played "
                      f"of {ev.audio_end_ms / 1000:.2f} s sent{note}")

    def latency_note(self, reply: Reply) -> str:
        parts = []
        if (ms := reply.latency_ms(reply.trigger_t)) is not None:
            parts.append(f"response {ms:.0f} ms")
        if (ms := reply.latency_ms(reply.voiced_t)) is not None:
            parts.append(f"voice-to-voice {ms:.0f} ms")
        return f"   ({', '.join(parts)})" if parts else ""

    # ---- the result ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        replies = list(self.replies.values())
        return {
            "type": "summary",
            "session_id": self.session_id,
            "mode": self.args.mode,
            "input_sample_rate": self.audio.rate,
            "input_s": round(self.audio.seconds, 3),
            "responses": len(replies),
            "response_status": [r.status for r in replies],
            "response_latency_ms": [r.latency_ms(r.trigger_t) for r in replies],
            "voice_to_voice_ms": [r.latency_ms(r.voiced_t) for r in replies],
            "barge_in_ms": self.barge_in_ms,
            "errors": self.errors,
            "transcripts": self.transcripts,
            "tool_calls": self.tool_calls,
            "reply_text": " ".join(r.text for r in replies if r.status == "completed" and r.text),
            "reply_audio_s": round(self.reply_bytes / 2 / self.audio_rate, 3) if self.audio_rate else 0.0,
            "reply_sample_rate": self.audio_rate,
            "output": str(self.args.output) if self.args.output and self.audio_parts and not self.rate_change
            else None,
            "closed_reason": self.closed_reason,
            "timed_out": self.timed_out,
        }

    @property
    def reply_bytes(self) -> int:
        return sum(map(len, self.audio_parts))


async def converse(talk: Talk, credentials: Credentials) -> Talk:
    """Run `talk`'s session: its drive and ack tasks beside the read of the server's events."""
    async with RealtimeSession(talk.args.target, credentials=credentials) as session:
        talk.session = session
        talk.on_event(session.created.proto, time.perf_counter())  # type: ignore[union-attr]
        tasks = [asyncio.create_task(talk.drive(), name="talk-send"),
                 asyncio.create_task(talk.ack_loop(), name="talk-ack")]
        try:
            async for event in session.events():  # ends quietly when talk cancels the call
                talk.on_event(event.proto, time.perf_counter())
            if talk.failure is not None:
                raise talk.failure
            if talk.close_cancelled:
                raise CliError(f"the server did not end the stream within {CLOSE_WAIT_S:.0f} s of session.close")
        finally:
            for task in [*tasks, *talk.tool_tasks]:
                task.cancel()
            await asyncio.gather(*tasks, *talk.tool_tasks, return_exceptions=True)  # a failed write fails the read
    return talk


@contextlib.contextmanager
def recorded(path: Path | None) -> Iterator[TalkRecording | None]:
    """The --record file (owner-only) for the talk run inside; a path it cannot be, or a
    recording that stopped (a full disk), is a one-line error."""
    if path is None:
        yield None
        return
    try:
        recording = TalkRecording(path)
    except OSError as exc:
        raise CliError(f"--record {path}: {exc.strerror or exc}") from None
    try:
        yield recording
    finally:
        if (error := recording.close()) is not None:
            raise CliError(f"--record {path}: the recording stopped: {error}")


def output_and_tools(args: argparse.Namespace) -> tuple[str | None, Any]:
    """The `-o` file's format (None without -o) and the `--tools` toolbox (None without it)."""
    if args.format is not None and args.output is None:
        raise CliError("--format is the format of -o: give -o OUT too")
    out_format = output_format(args.output, args.format) if args.output is not None else None
    try:
        return out_format, load_tools(args.tools) if args.tools is not None else None
    except ToolError as exc:
        raise CliError(f"--tools: {exc}") from None


def finish(talk: Talk, args: argparse.Namespace, out_format: str | None) -> None:
    """The end of a talk: `-o` written, the summary (or its JSON) printed, and what went wrong
    raised as one line."""
    problem = ""
    if talk.config_error:
        problem = f"the server rejected the session config: {talk.config_error}"
    elif talk.timed_out:
        problem = f"timed out after {args.timeout:g} s waiting for the session to go idle ({talk.waiting_for})"
    elif talk.closed_reason != "client":
        problem = f"the server closed the session: {talk.closed_reason or 'stream ended without session.closed'}"
    if args.output and talk.audio_parts and not talk.rate_change:
        with AudioWriter(args.output, talk.audio_rate, out_format) as writer:
            writer.write(b"".join(talk.audio_parts))
    if args.json:
        talk.flush_early()
        print(json.dumps(talk.summary(), ensure_ascii=False), flush=True, file=talk.text_out)
    else:
        _print_summary(talk)
    if problem:
        raise CliError(problem)
    if args.output and talk.rate_change:
        raise CliError(f"{talk.rate_change}: cannot write one audio file")
    if args.output and not talk.audio_parts:
        raise CliError(f"no reply audio to write to {args.output}")


def _print_summary(talk: Talk) -> None:
    if talk.config_error:
        return
    s = talk.summary()
    if talk.open_turn and talk.args.mode in VAD_TURNS and not talk.args.mic:
        print("note: the file ended inside a turn (no speech_stopped): add trailing silence longer than "
              "silence_duration_ms", file=sys.stderr)

    def ms(values: list[float | None]) -> str:
        return ", ".join("-" if v is None else f"{v:.0f}" for v in values) + " ms"

    line = f"{s['responses']} response{'s' if s['responses'] != 1 else ''}"
    if s["responses"]:
        line += f"; response latency {ms(s['response_latency_ms'])}; voice-to-voice {ms(s['voice_to_voice_ms'])}"
    if s["barge_in_ms"]:
        line += f"; barge-in {ms(s['barge_in_ms'])}"
    if s["errors"]:
        line += f"; errors: {', '.join(s['errors'])}"
    print(line, file=sys.stderr)
    if s["output"]:
        where = "standard output" if s["output"] == STDIO else s["output"]
        print(f"wrote {where}: {s['reply_audio_s']:.2f} s at {s['reply_sample_rate']} Hz", file=sys.stderr)
