"""`rtmedia talk --mic`: a live duplex session with the microphone as the user's voice and the speaker
playing the replies (clients/commands/audio_devices.py), shown in a live terminal view.

It is `talk`'s session (clients/commands/talk_session.py) with live devices in place of the file and the simulated
player: the microphone streams in --chunk-ms chunks; the speaker's own output timing says how much
of each reply was heard, and that is what `playback.ack` reports, so a barge-in truncates the
history there. Latencies are acoustic: voice-to-voice runs from the capture of the turn's last
voiced chunk to its reply's first sample reaching the speaker's converter; barge-in from the capture
of the interrupting speech's first voiced chunk to the reply's last sample out of the speaker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rtmedia.clients.commands.audio_devices import DeviceError, Microphone, Speaker
from rtmedia.clients.commands.common import CliError
from rtmedia.clients.commands.talk_session import (
    ACK_TICK_S,
    CONFIG_ID,
    CREATE_ID,
    VOICED_DBFS,
    InputAudio,
    Reply,
    Talk,
    converse,
    finish,
    output_and_tools,
    recorded,
)
from rtmedia.clients.credentials import from_args
from rtmedia.protocol.events import client_event
from rtmedia.protocol.turn_kinds import MANUAL, SEMANTIC_VAD, SERVER_VAD, VAD_TURNS

JITTER_MS = 60
COMMIT_ID = "talk-commit"
FULL_DUPLEX_NOTE = ("full duplex: speak over a reply to interrupt it. If the speaker's sound reaches the microphone "
                    "(no headset, no echo cancellation), rtmedia hears itself and stops: use --half-duplex")
HALF_DUPLEX_NOTE = "half duplex: the microphone is muted while a reply plays, so you cannot interrupt it"
LEVEL_BARS = " ▁▂▃▄▅▆▇█"


@dataclass
class MicTalk(Talk):
    mic: Microphone | None = None
    speaker: Speaker | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    state: str = "connecting"
    level_dbfs: float = -120.0
    muted: bool = False
    turn_open: bool = False  # push-to-talk: space started a turn
    live: Any = None  # rich.live.Live while the terminal view runs
    samples_sent: int = 0
    playout_ms: list[float] = field(default_factory=list)  # first reply audio received -> at the speaker
    received_t: dict[str, float] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)  # replies acknowledged to their end
    done_items: set[str] = field(default_factory=set)  # user items whose transcript is final
    started_t: float = 0.0
    cpu_start: float = 0.0

    # ---- output -----------------------------------------------------------------------------
    def say(self, now: float, text: str) -> None:
        if self.args.json:
            return
        if self.live is not None:
            self.live.console.print(f"[{self.t(now):6.2f} s] {text}", markup=False, highlight=False)
        else:
            print(f"[{self.t(now):6.2f} s] {text}", flush=True, file=self.text_out)

    def show_partial(self, text: str) -> None:
        pass  # the live view shows self.partial

    def describe_config(self, config: Any) -> None:
        assert self.mic is not None and self.speaker is not None
        self.state = "connected"
        if self.args.json:
            return
        mode = "push-to-talk (space starts a turn, space again sends it)" if self.args.push_to_talk else \
            self.args.mode
        self.say(time.perf_counter(), f"session {self.session_id}: microphone {self.mic.name!r} at {self.mic.rate} Hz, "
                                      f"speaker {self.speaker.name!r} at {self.speaker.rate} Hz, {mode}, responder "
                                      f"{config.responder or '(default)'}, voice {config.voice or '(default)'}")
        self.say(time.perf_counter(), HALF_DUPLEX_NOTE if self.args.half_duplex else FULL_DUPLEX_NOTE)

    def render(self) -> Any:
        from rich.table import Table

        now = time.perf_counter()
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        level = max(0.0, min(1.0, (self.level_dbfs + 60) / 60))
        meter = LEVEL_BARS[-1] * int(level * 20) + LEVEL_BARS[int(level * 20 % 1 * 8)] if level else ""
        mic = "muted" if self.muted else ("idle: space starts a turn" if self.args.push_to_talk and not self.turn_open
                                          else f"{meter:<21} {self.level_dbfs:6.1f} dBFS")
        grid.add_row("rtmedia", f"{self.state} · {'push-to-talk' if self.args.push_to_talk else self.args.mode} · "
                                f"{'half' if self.args.half_duplex else 'full'} duplex · Ctrl-C ends")
        grid.add_row("mic", mic)
        partial = next((p for k, p in reversed(self.partial.items()) if k not in self.done_items), "")
        grid.add_row("you", f"… {partial}" if partial else ("speaking" if self.open_turn else ""))
        speaking = next((r for r in reversed(self.replies.values())
                         if self.speaker is not None and not r.cleared and self.speaker.pending(r.response_id, now)),
                        None)
        grid.add_row("reply", f"{speaking.text}" if speaking else "")
        v2v = [r.latency_ms(r.voiced_t) for r in self.replies.values()]
        last = next((v for v in reversed(v2v) if v is not None), None)
        grid.add_row("latency", (f"voice-to-voice {last:.0f} ms" if last is not None else "-")
                     + f" · barge-ins {len(self.barge_in_ms)}")
        return grid

    # ---- sending ------------------------------------------------------------------------------
    async def _drive(self) -> None:
        assert self.mic is not None and self.speaker is not None
        mode = MANUAL if self.args.push_to_talk else self.args.mode
        session = self.session_config(self.mic.rate, mode, self.speaker.rate)
        await self.created.wait()
        await self.write("session.update", event_id=CONFIG_ID, session=session)
        await self.configured.wait()
        if not self.config_error:
            self.state = "listening"
            await self.stream_mic()
        self.state = "closing"
        await self.close_session()

    async def stream_mic(self) -> None:
        assert self.mic is not None and self.speaker is not None
        self.origin = time.perf_counter()  # t_ms counts from here: the microphone is live
        self.flush_early()
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                get = asyncio.ensure_future(self.mic.next())
                await asyncio.wait([get, stop], return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    break
                chunk = get.result()  # a DeviceError ends the session with its line
                self.level_dbfs = max(-120.0, chunk.level_dbfs)
                if chunk.captured_t < self.origin or (self.args.push_to_talk and not self.turn_open):
                    continue  # captured before the session was live, or between push-to-talk turns
                self.muted = self.args.half_duplex and self.speaker.audible()
                pcm = bytes(len(chunk.pcm)) if self.muted else chunk.pcm
                async with self.write_lock:
                    if self.closing:
                        return
                    self.audio.starts_ms.append(self.input_ms)
                    self.audio.voiced.append(not self.muted and chunk.level_dbfs > VOICED_DBFS)
                    self.sent_t.append(chunk.captured_t)  # latencies are from the capture
                    self.samples_sent += len(pcm) // 2
                    await self.session.send(client_event("input_audio_buffer.append", audio=pcm))
                    if self.recording is not None:  # what was sent: silence while muted
                        self.recording.sent(pcm, self.mic.rate, chunk.captured_t)
                self.last_chunk_t = chunk.captured_t
        finally:
            stop.cancel()

    @property
    def input_ms(self) -> float:
        """The session's input audio so far."""
        return self.samples_sent * 1000 / self.audio.rate

    def on_key(self, key: bytes) -> None:
        if key == b" " and self.args.push_to_talk:
            self.track(self.toggle_turn())
        elif key in (b"q", b"\x04"):
            self.stop.set()

    def track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tool_tasks.add(task)
        task.add_done_callback(self.tool_tasks.discard)

    async def toggle_turn(self) -> None:
        """Push-to-talk: the first space interrupts any reply and starts a turn; the next sends it."""
        now = time.perf_counter()
        if not self.turn_open:
            for reply in self.replies.values():
                if not reply.status:
                    await self.write("response.cancel", response_id=reply.response_id)
                if not reply.cleared and self.speaker is not None and self.speaker.pending(reply.response_id, now):
                    reply.cleared = True
                    self.speaker.clear(reply.response_id)
                    self.say(now, f"~ you interrupted reply {reply.response_id}")
            await self.write("input_audio_buffer.clear")
            self.turn_floor_ms = self.input_ms
            self.turn_open = True
            self.say(now, "listening… (space sends the turn)")
            return
        self.turn_open = False
        end_ms = self.input_ms
        self.create_pending = True
        self.trigger = (now, self.last_voiced_t(self.turn_floor_ms, end_ms))
        self.turn_floor_ms = end_ms
        await self.write("input_audio_buffer.commit", event_id=COMMIT_ID)
        await self.write("response.create", event_id=CREATE_ID)

    # ---- playback -------------------------------------------------------------------------------
    def on_event(self, msg: Any, now: float) -> None:
        super().on_event(msg, now)
        kind = msg.WhichOneof("event")
        ev = getattr(msg, kind or "", None)
        if kind == "response_done" and self.speaker is not None:
            self.speaker.end(ev.response_id)
        elif kind == "input_audio_buffer_speech_tentative" and self.speaker is not None:
            self.speaker.paused = True  # confirmed interruptions: hold the reply while the voice is judged
        elif kind in ("input_audio_buffer_backchannel", "input_audio_buffer_speech_started") and \
                self.speaker is not None:
            self.speaker.paused = False  # judged: it goes on (an interruption's cleared follows)
        elif kind == "conversation_item_input_audio_transcription_completed":
            self.done_items.add(ev.item_id)
        elif kind == "session_closed":
            self.state = f"closed ({ev.reason})"

    def on_audio(self, ev: Any, now: float) -> None:
        reply = self.replies.get(ev.response_id)
        if reply is None or not ev.audio or reply.cleared or self.speaker is None:
            return
        self.note_rate(ev.sample_rate)
        if ev.sample_rate != self.speaker.rate:
            self.fail(CliError(f"the server sent reply audio at {ev.sample_rate} Hz; the speaker plays "
                               f"{self.speaker.rate} Hz"))
            return
        if self.args.output is not None:
            self.audio_parts.append(ev.audio)
        self.received_t.setdefault(ev.response_id, now)
        reply.add_received(len(ev.audio) // (2 * max(1, ev.channels)), ev.sample_rate)
        self.speaker.play(ev.response_id, ev.audio)
        if self.recording is not None:
            self.recording.played(ev.response_id, ev.audio, ev.sample_rate, now)

    def on_cleared(self, ev: Any, now: float) -> None:
        reply = self.replies.get(ev.response_id)
        if reply is None or self.speaker is None:
            return
        reply.cleared = True
        self.speaker.paused = False
        self.speaker.clear(ev.response_id)  # the ack loop reports what still comes out, then the end
        if self.recording is not None:
            self.recording.cleared(ev.response_id, now)

    def heard_ms(self, reply: Reply, now: float) -> int:
        return reply.ack.acked_ms if self.speaker is None else min(reply.received_ms,
                                                               self.speaker.played_ms(reply.response_id, now))

    def interrupt(self) -> None:
        """Ctrl-C: close the session; a second Ctrl-C does not wait for the server."""
        if self.stop.is_set():
            self.session.cancel_stream()
        self.stop.set()

    def fail(self, exc: Exception) -> None:
        if self.failure is None:
            self.failure = exc
            self.session.cancel_stream()

    async def ack_loop(self) -> None:
        """playback.ack from what the speaker played: every ~200 ms, and once a reply is out or cut."""
        assert self.speaker is not None
        while True:
            await asyncio.sleep(ACK_TICK_S)
            now = time.perf_counter()
            if self.speaker.failed:
                self.fail(CliError(self.speaker.failed))
                return
            for reply in list(self.replies.values()):
                rid = reply.response_id
                if self.closing:
                    return
                if rid in self.finished or rid not in self.received_t:
                    continue
                if reply.first_audio_t is None and rid in self.speaker.first_dac:
                    self.first_played(reply, now)
                played = self.heard_ms(reply, now)
                out = (bool(reply.status) or reply.cleared) and not self.speaker.pending(rid, now)
                ack = reply.ack.due(played, out)
                if ack is not None:
                    await self.write("playback.ack", response_id=rid, played_ms=ack)
                if out:
                    self.finished.add(rid)
                    self.speaker.forget(rid)
                    if reply.cleared:
                        self.interrupted(reply, now)

    def first_played(self, reply: Reply, now: float) -> None:
        assert self.speaker is not None
        reply.first_audio_t = self.speaker.first_dac[reply.response_id]
        self.playout_ms.append(round((reply.first_audio_t - self.received_t[reply.response_id]) * 1000, 1))
        self.state = "speaking"
        self.say(now, f"rtmedia speaking{self.latency_note(reply)}")

    def interrupted(self, reply: Reply, now: float) -> None:
        """A cut reply's last sample is out: barge-in latency from the interrupting speech's onset."""
        note = ""
        if self.last_started is not None and self.last_started[0] >= reply.created_t:
            onset = self.onset_t(self.last_started[1])
            if onset is not None:
                self.barge_in_ms.append(round((now - onset) * 1000, 1))
                note = f" (barge-in {self.barge_in_ms[-1]:.0f} ms)"
        self.state = "listening"
        self.say(now, f"~ reply {reply.response_id} cut after {reply.ack.acked_ms / 1000:.2f} s heard{note}")

    # ---- the result -------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        assert self.mic is not None and self.speaker is not None
        s = super().summary()
        session_s = time.perf_counter() - self.started_t
        s.update({
            "mode": "push_to_talk" if self.args.push_to_talk else self.args.mode,
            "input_s": round(self.samples_sent / self.mic.rate, 3),
            "input_device": self.mic.name, "output_device": self.speaker.name,
            "output_sample_rate": self.speaker.rate, "duplex": "half" if self.args.half_duplex else "full",
            "heard_ms": [r.ack.acked_ms for r in self.replies.values()],
            "playout_ms": self.playout_ms, "output_latency_ms": round(self.speaker.output_latency_s * 1000, 1),
            "underruns": self.speaker.underruns, "device_underflows": self.speaker.device_underflows,
            "input_overflows": self.mic.overflows,
            "session_s": round(session_s, 3),
            "cpu_ms_per_session_s": round((time.process_time() - self.cpu_start) * 1000 / max(session_s, 1e-9), 2),
            "reply_audio_s": round(sum(r.received_ms for r in self.replies.values()) / 1000, 3),
        })
        return s


@contextlib.contextmanager
def _keys(talk: MicTalk, loop: asyncio.AbstractEventLoop) -> Any:
    """Push-to-talk: the terminal in cbreak mode (keys arrive one by one, Ctrl-C still interrupts)."""
    if not talk.args.push_to_talk:
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read() -> None:
        keys = os.read(fd, 64)
        if not keys:  # the terminal went away
            loop.remove_reader(fd)
        for key in keys:
            talk.on_key(bytes([key]))

    loop.add_reader(fd, read)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _live(talk: MicTalk, credentials: Any) -> MicTalk:
    loop = asyncio.get_running_loop()
    args = talk.args
    talk.mic = Microphone(args.input_device, args.chunk_ms, loop)
    try:
        talk.speaker = Speaker(args.output_device, args.output_rate or 24000, args.jitter_ms or JITTER_MS)
    except DeviceError:
        talk.mic.close()
        raise
    talk.audio.rate = talk.audio.source_rate = talk.mic.rate
    loop.add_signal_handler(signal.SIGINT, talk.interrupt)
    loop.add_signal_handler(signal.SIGTERM, talk.interrupt)
    if args.duration is not None:
        loop.call_later(args.duration, talk.stop.set)
    view = contextlib.nullcontext()
    if not args.json and talk.text_out.isatty():
        from rich.console import Console
        from rich.live import Live

        view = talk.live = Live(get_renderable=talk.render, console=Console(file=talk.text_out),
                                refresh_per_second=10, transient=True)
    talk.started_t, talk.cpu_start = time.perf_counter(), time.process_time()
    try:
        with view, _keys(talk, loop):
            return await converse(talk, credentials)
    finally:
        talk.live = None
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)
        talk.mic.close()
        talk.speaker.close()


def check_mic_args(args: argparse.Namespace) -> None:
    if args.input is not None:
        raise CliError(f"--mic takes the voice from the microphone: drop IN ({args.input})")
    if args.push_to_talk and args.mode != SERVER_VAD:
        raise CliError(f"--push-to-talk makes the turns by hand: drop --mode {args.mode}")
    if args.mode not in VAD_TURNS and not args.push_to_talk:
        raise CliError(f"--mode {args.mode} is for files; with --mic, manual turns are --push-to-talk")
    if args.push_to_talk and args.half_duplex:
        raise CliError("--push-to-talk already decides when the microphone is heard: drop --half-duplex")
    if args.push_to_talk and not sys.stdin.isatty():
        raise CliError("--push-to-talk reads the space key from a terminal, and standard input is not one")
    if args.eagerness is not None and args.mode != SEMANTIC_VAD:
        raise CliError(f"--eagerness is for --mode semantic_vad, not {args.mode}")
    if args.realtime:
        raise CliError("--realtime is for files: a microphone is always real time")
    if not 1 <= args.chunk_ms <= 1000:
        raise CliError(f"--chunk-ms must be 1..1000, got {args.chunk_ms}")


def cmd_talk_mic(args: argparse.Namespace) -> None:
    check_mic_args(args)
    credentials = from_args(args)
    out_format, toolbox = output_and_tools(args)
    with recorded(args.record) as recording:
        talk = MicTalk(args, InputAudio(0, 0, [], [], [], args.chunk_ms), toolbox=toolbox, recording=recording)
        try:
            asyncio.run(_live(talk, credentials))
        except DeviceError as exc:
            raise CliError(str(exc)) from None
    finish(talk, args, out_format)
