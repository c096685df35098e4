"""The `/v1/realtime` socket's pumps (web/openai/realtime_ws.py) against a client that stops reading:
the send that waits `send_timeout_s` ends the socket (close 1008) and the Converse call, so
nothing piles up in the front."""

from __future__ import annotations

import asyncio

import grpc
from rtmedia.clients.session import RealtimeSession
from rtmedia.protocol.events import server_event
from rtmedia.web.openai.realtime_config import new_config
from rtmedia.web.openai.realtime_events import Translator
from rtmedia.web.openai.realtime_ws import RealtimeLimits, RealtimeSocket


class StuckSocket:
    """A WebSocket whose peer never reads: every send waits for good."""

    def __init__(self) -> None:
        self.closed = False
        self.close_code = None
        self.sent = 0

    async def send_str(self, text: str) -> None:
        self.sent += 1
        await asyncio.Event().wait()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    async def close(self, code: int, message: bytes = b"") -> None:
        self.closed, self.close_code = True, code


class Call:
    """A Converse call that keeps sending events."""

    def __init__(self) -> None:
        self.cancelled = False

    async def read(self):
        await asyncio.sleep(0.01)
        return server_event("input_audio_buffer.speech_started", item_id="item_1", audio_start_ms=0)

    async def write(self, request) -> None:
        pass

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return self.cancelled


def session_on(call: Call) -> RealtimeSession:
    """A RealtimeSession over the stand-in call (as the front's, once opened)."""
    session = RealtimeSession(channel=object())
    session.call = call
    return session


async def test_a_client_that_stops_reading_is_closed_and_its_call_ended():
    ws, call = StuckSocket(), Call()
    translator = Translator(new_config("gpt-realtime", "realtime"))
    socket = RealtimeSocket(ws, session_on(call), translator, RealtimeLimits(send_timeout_s=0.2))
    first = [server_event("session.updated", session={})]
    await asyncio.wait_for(socket.run(first), 5)
    assert socket.closed_reason == "client_too_slow"
    assert ws.closed and ws.close_code == 1008 and call.cancelled
    assert ws.sent == 1  # one send waited; nothing more was queued behind it


async def test_the_servers_end_of_the_call_closes_the_socket():
    class Ended(Call):
        async def read(self):
            return grpc.aio.EOF

    ws = StuckSocket()
    ws.send_str = lambda text: asyncio.sleep(0)  # a reading client
    socket = RealtimeSocket(ws, session_on(Ended()), Translator(new_config("gpt-realtime", "realtime")), RealtimeLimits())
    await asyncio.wait_for(socket.run([]), 5)
    assert ws.closed and ws.close_code == 1000


def test_a_keypad_key_is_openais_dtmf_event():
    translator = Translator(new_config("gpt-realtime", "realtime"))
    [event] = translator.from_server(server_event("input_audio_buffer.dtmf_event_received", event="5",
                                                  received_at=1764900000))
    assert (event["type"], event["event"], event["received_at"]) == ("input_audio_buffer.dtmf_event_received", "5",
                                                                     1764900000)
