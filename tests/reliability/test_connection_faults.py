"""Connection faults, the quick version of tests/reliability/connection_faults.py: one real
`rtmedia serve` (echo responder), a warm-up round, then two rounds of vanishing clients (a
third cancel, a third close their channel, a third are SIGKILLed with their process), slow
readers and clients that stop sending without closing. After each round every resource of the
server (sessions, lane queues, ASR worker gauges; threads, fds and RSS of the main process
and of each worker) is back at the baseline, and every silent client was closed by its idle
timeout."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig

from tests.reliability.connection_faults import Attack, run
from tests.reliability.vanishing import RATE, speech_audio
from tests.support.converse import Conversation
from tests.support.waits import until

pytestmark = pytest.mark.e2e

ATTACK = Attack(clients=60, slow_readers=3, slow_read_s=6.0, silent=4, idle_timeout_s=1)


@pytest.mark.timeout(420)
async def test_vanishing_slow_and_silent_clients_leave_nothing_behind():
    result = await run(rounds=2, attack=ATTACK, settle_s=45.0)
    assert result["ok"], result["problems"]
    assert len(result["rounds"]) == 2
    for round_ in result["rounds"]:
        # The attack reached the server: the killed process's sessions were open at once.
        assert round_["peak_sessions"] >= ATTACK.clients // 3
        assert round_["vanishing"]["sigkilled"] == ATTACK.clients // 3
        assert round_["slow_readers"]["events_read"] >= ATTACK.slow_readers
        assert round_["silent"]["closed_by_idle_timeout"] == ATTACK.silent
        assert not round_["not_returned"]
    baseline = result["baseline"]
    assert baseline["gauges"]["rtmedia_sessions_active"] == 0
    # The recogniser (Whisper) runs in the server's process: it is the one watched.
    processes = baseline["processes"]
    assert "main" in processes and not any(name.startswith("worker") for name in processes), processes


@pytest.fixture
async def in_process():
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1, llm=False, default_responder="echo"))
    await server.start()
    yield server
    await server.stop(0)


async def test_a_cancellation_during_the_release_does_not_keep_the_session(in_process, monkeypatch):
    """The call's cancellation may reach a session's task while it frees what the session
    holds (a client that vanishes while the server is blocked sending to it: the send fails
    first, the cancellation follows). Here the client cancels while the session's ASR stream
    is being closed; the session is still forgotten, its ASR stream closed and its task ends."""
    engine = in_process.scheduler.lane("asr").engine
    close_stream, loop = engine.close_stream, asyncio.get_running_loop()
    vanish: list = []

    def vanishing_while_closing(stream) -> None:
        for cancel in vanish:
            loop.call_soon_threadsafe(cancel)
        time.sleep(0.5)  # the cancellation reaches the server while the close is awaited
        close_stream(stream)

    monkeypatch.setattr(engine, "close_stream", vanishing_while_closing)
    audio = speech_audio()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{in_process.port}") as channel:
        async with Conversation(channel) as c:
            await c.wait_for("session.created")
            tasks = [s.writer for s in in_process.realtime.sessions.values()]
            c.send("session.update", session={"input_audio_format": {"sample_rate": RATE}})
            await c.stream(audio + bytes(RATE), RATE, chunk_ms=100, speed=4.0)
            await c.wait_for("input_audio_buffer.speech_started")
            assert engine.open_streams == 1
            vanish.append(c.cancel)
            c.send("session.close")
            await c.ended()
    await until(lambda: not in_process.realtime.sessions and engine.open_streams == 0, timeout=5, interval=0.1,
                what="the session forgotten and its ASR stream closed",
                seen=lambda: (len(in_process.realtime.sessions), engine.open_streams))
    assert not in_process.realtime.sessions, "the session was never forgotten"
    assert engine.open_streams == 0, "its ASR stream was never closed"
    assert len(tasks) == 1 and tasks[0].done()
