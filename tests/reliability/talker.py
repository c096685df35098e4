"""A well-behaved Converse session that keeps talking: the yardstick the fuzzing is measured
against. Its microphone streams 20 ms chunks at real-time pace (silence between turns); each
turn it says one sentence, the server's VAD ends the turn and the server answers. It records
each turn's response latency (docs/protocol.md: from `input_audio_buffer.speech_stopped` to the
first reply audio byte at the client), the response's status and any error events.

In-process: `Talker(channel, metadata).run(stop)`. As a process of its own (so that the fuzzing
client's work does not slow its clock), it prints one JSON object per turn, and opens a new
session when the server ends one (`max_session_s`, an hour by default, ends any session):

    .venv/bin/python tests/reliability/talker.py --target HOST:PORT [--token TOKEN]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rtmedia.protocol.events import client_event  # noqa: E402
from rtmedia.v1 import common_pb2, realtime_pb2_grpc  # noqa: E402

RATE = 16000
CHUNK_MS = 20
TURN_TIMEOUT_S = 60.0  # a turn whose response has not finished by then counts as failed
SENTENCE = "What time does the library open on Sunday morning?"
TRAILING_SILENCE_S = 1.0
MAX_BEHIND_S = 0.2  # the microphone this far behind its clock: it was stalled, not slow


@dataclass
class TurnResult:
    t: float  # time.monotonic() when the response finished
    latency_s: float | None  # speech_stopped -> first audio delta
    status: str  # the response's status, or "timeout"


@dataclass
class Talker:
    """In-process, the talker shares the event loop with whatever else runs on it; a test
    framework may hold the loop still for seconds (Hypothesis draws its cases between two runs of
    the loop). The server stood still as well then, so the microphone does not send the audio of
    that time in one burst (which the server would rightly discard as `input_backpressure`): it
    goes on at real-time pace and records the stall in `stalls`."""

    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...] = ()
    pcm: bytes = field(default=b"", repr=False)
    turns: list[TurnResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ended: str = ""  # how the stream ended, once it has
    stalls: list[float] = field(default_factory=list)  # seconds the microphone's clock stood still

    def __post_init__(self) -> None:
        if not self.pcm:
            self.pcm = _speech(SENTENCE)
        self._say = bytearray()
        self._stopped_at: float | None = None
        self._latency: float | None = None
        self._done: asyncio.Queue[str] = asyncio.Queue()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.on_turn: Any = None  # called with each TurnResult

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's reports
        printer.text(f"Talker({len(self.turns)} turns, {len(self.errors)} errors)")

    async def _requests(self):
        while (request := await self._queue.get()) is not None:
            yield request

    async def _mic(self) -> None:
        step = RATE * CHUNK_MS // 1000 * 2
        silence = bytes(step)
        started, n = time.perf_counter(), 0
        while True:
            chunk = bytes(self._say[:step]) if self._say else silence
            del self._say[:step]
            self._queue.put_nowait(client_event("input_audio_buffer.append", audio=chunk.ljust(step, b"\0")))
            n += 1
            behind = time.perf_counter() - (started + n * CHUNK_MS / 1000)
            if behind > MAX_BEHIND_S:  # the loop did not run (see the class): go on at real-time pace
                self.stalls.append(behind)
                started += behind
            await asyncio.sleep(max(0.0, started + n * CHUNK_MS / 1000 - time.perf_counter()))

    async def _read(self, call: Any) -> None:
        async for event in call:
            kind = event.WhichOneof("event")
            if kind == "input_audio_buffer_speech_stopped":
                self._stopped_at, self._latency = time.perf_counter(), None
            elif kind == "response_output_audio_delta":
                if self._stopped_at is not None and self._latency is None:
                    self._latency = time.perf_counter() - self._stopped_at
            elif kind == "response_done":
                self._done.put_nowait(realtime_status(event.response_done.status))
            elif kind == "error":
                self.errors.append(f"{event.error.code}: {event.error.message}")

    async def run(self, stop: asyncio.Event, turns: int | None = None) -> None:
        """Talk until `stop` is set (or `turns` turns are done), then close the session."""
        call = realtime_pb2_grpc.RealtimeServiceStub(self.channel).Converse(self._requests(), metadata=self.metadata)
        self._queue.put_nowait(client_event("session.update", session={
            "input_audio_format": {"encoding": common_pb2.AUDIO_ENCODING_PCM16, "sample_rate": RATE},
            "responder": "echo"}))
        reader = asyncio.ensure_future(self._read(call))
        mic = asyncio.ensure_future(self._mic())
        try:
            while not stop.is_set() and (turns is None or len(self.turns) < turns) and not reader.done():
                self._say += self.pcm + bytes(int(RATE * TRAILING_SILENCE_S) * 2)
                waiter = asyncio.ensure_future(self._done.get())
                stopping = asyncio.ensure_future(stop.wait())
                await asyncio.wait([waiter, stopping, reader], timeout=TURN_TIMEOUT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if waiter.done():
                    result = TurnResult(time.monotonic(), self._latency, waiter.result())
                elif stop.is_set() or reader.done():
                    waiter.cancel()
                    break
                else:
                    waiter.cancel()
                    result = TurnResult(time.monotonic(), None, "timeout")
                self.turns.append(result)
                if self.on_turn is not None:
                    self.on_turn(result)
                await asyncio.sleep(0.3)
        finally:
            mic.cancel()
            self._queue.put_nowait(client_event("session.close", reason="done"))
            self._queue.put_nowait(None)
            try:
                await asyncio.wait_for(reader, 10)
                self.ended = "OK"
            except grpc.aio.AioRpcError as exc:
                self.ended = exc.code().name
            except (TimeoutError, asyncio.CancelledError):
                call.cancel()
                self.ended = "timeout"
            await asyncio.gather(mic, return_exceptions=True)


def realtime_status(status: int) -> str:
    from rtmedia.v1 import realtime_pb2

    return realtime_pb2.ResponseStatus.Name(status).removeprefix("RESPONSE_STATUS_").lower()


def _speech(text: str) -> bytes:
    from tests.support.speech import Speaker

    return Speaker().say(text, RATE).tobytes()


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation, or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    async with grpc.aio.insecure_channel(args.target) as channel:
        print(json.dumps({"ready": True}), flush=True)
        all_errors: list[str] = []  # every session's
        sessions = 0
        while not stop.is_set():
            if sessions:  # the server ended the last one (max_session_s): a client opens another
                await asyncio.sleep(1.0)
            talker = Talker(channel, metadata, errors=all_errors)
            talker.on_turn = lambda turn: print(json.dumps({
                "t": turn.t, "latency_s": turn.latency_s, "status": turn.status,
                "errors": len(all_errors)}), flush=True)
            await talker.run(stop)
            sessions += 1
        print(json.dumps({"ended": talker.ended, "sessions": sessions, "errors": all_errors[:20]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="A well-behaved Converse session that keeps talking; one JSON "
                                                 "object per turn on stdout.")
    parser.add_argument("--target", required=True, help="the server, HOST:PORT")
    parser.add_argument("--token", default=None, help="bearer token, if the server wants one")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
