"""Two real `rtmedia serve` replicas behind Debian's haproxy (tests/support/proxy.py: TLS at the
proxy, h2c to the replicas, least connections, readiness from /readyz): people talk through it,
one replica gets SIGTERM while one of its sessions is mid-turn and another mid-reply, and

- every turn in flight there is answered and its reply completes, then its sessions close
  with server_shutdown and the process exits 0;
- the proxy takes that replica out of rotation (its /readyz says 503 at once, while the drain
  delay still admits), and the sessions opened after land on the other replica;
- nothing is refused: every session any caller opened was admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field

import grpc
import pytest

from tests.support.certs import make_certs
from tests.support.converse import Conversation
from tests.support.proxy import HAPROXY, Haproxy, combined_pem, replicas
from tests.support.speech import Speaker

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAPROXY, reason="needs haproxy")]

REPLICA_ARGS = ("--no-llm", "--responder", "echo", "--no-riva", "--asr-workers", "1", "--asr-decoders", "2",
                "--vad-threads", "1", "--grace", "30", "--drain-delay", "1")
RATE = 16000
CALLERS = 4
SENTENCE = "Could you tell me when the next train to the city leaves?"


@dataclass
class Held:
    """One session a caller held: where it landed and what happened in it."""

    replica: str
    conversation: Conversation
    opened: float


@dataclass
class Caller:
    """A person talking through the proxy: says the sentence, waits for the reply, says it again;
    when the server ends the session (a drain) it opens another, as a client does."""

    channel: grpc.aio.Channel
    pcm: bytes
    held: list[Held] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # refusals and streams that failed
    turns: list[tuple[float, str]] = field(default_factory=list)  # (when its reply was done, replica)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            async with Conversation(self.channel) as c:
                try:
                    await c.wait_for("session.created", timeout=20)
                except AssertionError:  # the stream ended (refused) or nothing came
                    self.errors.append(f"{c.error.code().name}: {c.error.details()}" if c.error else "no session")
                    await asyncio.sleep(0.2)
                    continue
                replica = dict(await c.call.initial_metadata()).get("rtmedia-replica", "?")
                closing = asyncio.create_task(self._half_close_when_closed(c))
                self.held.append(Held(replica, c, time.monotonic()))
                while not stop.is_set() and not c.of_type("session.closed"):
                    done = len(c.of_type("response.done"))
                    await c.stream(self.pcm, RATE)
                    try:
                        await c.wait_for("response.done", count=done + 1, timeout=60)
                        self.turns.append((time.monotonic(), replica))
                    except AssertionError:  # the stream ended: closed by the server (drained), or failed
                        if c.error is not None:
                            self.errors.append(f"{c.error.code().name}: {c.error.details()} ({replica})")
                        break
                    await asyncio.sleep(0.3)
                c.end_requests()
                closing.cancel()

    @staticmethod
    async def _half_close_when_closed(c: Conversation) -> None:
        """A client stops sending once the server says session.closed."""
        with contextlib.suppress(AssertionError):
            await c.wait_for("session.closed", timeout=3600)
        c.end_requests()


def phase(c: Conversation) -> str:
    """mid-turn (the user is speaking), mid-reply (a response is out), or idle."""
    last = [e["type"] for e in c.events if e["type"] in ("input_audio_buffer.speech_started", "response.created",
                                                          "response.done", "input_audio_buffer.speech_stopped")]
    if not last:
        return "idle"
    return {"input_audio_buffer.speech_started": "mid-turn", "response.created": "mid-reply"}.get(last[-1], "idle")


async def test_a_replica_drains_behind_haproxy(tmp_path):
    certs = make_certs(tmp_path / "certs")
    pcm = Speaker().say(SENTENCE, RATE).tobytes() + bytes(RATE * 2)  # the sentence, then 1 s of silence
    with replicas(["r1", "r2"], *REPLICA_ARGS, log_dir=tmp_path) as (r1, r2):
        proxy = Haproxy(tmp_path, [r1, r2], combined_pem(certs.server_cert, certs.server_key, tmp_path / "p.pem"))
        try:
            await asyncio.to_thread(proxy.wait_status, {"r1": "UP", "r2": "UP"})
            credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes())
            async with grpc.aio.secure_channel(proxy.target, credentials) as channel:
                stop = asyncio.Event()
                callers = [Caller(channel, pcm) for _ in range(CALLERS)]
                tasks = []
                for caller in callers:  # staggered, so turns and replies interleave
                    tasks.append(asyncio.create_task(caller.run(stop)))
                    await asyncio.sleep(1.3)
                on_r1 = [h for c in callers for h in c.held if h.replica == "r1"]
                assert len(on_r1) == CALLERS // 2, [h.replica for c in callers for h in c.held]
                # SIGTERM r1 once one of its sessions is mid-turn and another mid-reply
                deadline = time.monotonic() + 40
                while {phase(h.conversation) for h in on_r1} != {"mid-turn", "mid-reply"}:
                    assert time.monotonic() < deadline, [phase(h.conversation) for h in on_r1]
                    await asyncio.sleep(0.01)
                in_flight = {id(h): phase(h.conversation) for h in on_r1}
                r1.process.send_signal(signal.SIGTERM)
                sigterm = time.monotonic()
                await asyncio.to_thread(proxy.wait_status, {"r1": "DOWN", "r2": "UP"}, 5)
                out_of_rotation = time.monotonic() - sigterm
                for h in on_r1:  # each drained session closes once its turn is answered
                    await h.conversation.wait_for("session.closed", timeout=40)
                assert await asyncio.to_thread(r1.process.wait, 40) == 0
                # every caller then holds a session on r2 and completes a turn there
                while not all(any(t > sigterm and replica == "r2" for t, replica in c.turns) for c in callers):
                    assert time.monotonic() < sigterm + 60, [[h.replica for h in c.held] for c in callers]
                    await asyncio.sleep(0.1)
                stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            proxy.close()
    assert out_of_rotation < 1.0  # within the drain delay: no session was sent to a replica refusing
    assert not [c.errors for c in callers if c.errors]
    for h in on_r1:
        c = h.conversation
        stopped = c.of_type("input_audio_buffer.speech_stopped")
        done = c.of_type("response.done")
        assert len(done) == len(stopped) and all(d["status"] == "completed" for d in done), \
            (in_flight[id(h)], [e["type"] for e in c.events])
        assert c.of_type("session.closed")[0]["reason"] == "server_shutdown"
        assert c.error is None
    # the session mid-turn at SIGTERM had that turn heard to its end and answered
    mid_turn = next(h for h in on_r1 if in_flight[id(h)] == "mid-turn")
    assert mid_turn.conversation.of_type("response.done")[-1]["status"] == "completed"
    later = [h.replica for c in callers for h in c.held if h.opened > sigterm + out_of_rotation]
    assert later and set(later) == {"r2"}, later
