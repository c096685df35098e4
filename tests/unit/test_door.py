"""The doors' one skeleton (web/door.py) on a fake Converse stream: dispatch on canonical event
names, the close rule, and the one error mapping."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.session import RealtimeSession
from rtmedia.protocol.events import client_event, event_type, server_event
from rtmedia.web.door import CLOSE_WAIT_S, STOP, Door, fault_of, on


class Stream:
    """A fake Converse call: `events` are read in order; then it waits, or ends (EOF) once the
    client said session.close (the server's answer is session.closed), or raises `fail`."""

    def __init__(self, events=(), answer_close=True, fail: grpc.StatusCode | None = None) -> None:
        self.events = list(events)
        self.written: list = []
        self.answer_close, self.fail = answer_close, fail
        self.was_cancelled = self.half_closed = False
        self.more = asyncio.Event()

    async def read(self):
        while not self.events:
            if self.fail is not None:
                raise FakeRpcError(self.fail)
            self.more.clear()
            await self.more.wait()
        return self.events.pop(0)

    async def write(self, request) -> None:
        self.written.append(request)
        if event_type(request) == "session.close" and self.answer_close:
            self.events += [server_event("session.closed", reason="client"), grpc.aio.EOF]
            self.more.set()

    async def done_writing(self) -> None:
        self.half_closed = True

    def cancel(self) -> bool:
        self.was_cancelled = True
        self.more.set()
        return True

    def cancelled(self) -> bool:
        return self.was_cancelled

    def done(self) -> bool:
        return self.was_cancelled


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="broken")


def on_stream(door: Door, stream: Stream) -> Door:
    session = RealtimeSession(channel=object())
    session.call = stream
    door.session = session
    return door


class Recorder(Door):
    def __init__(self, inputs=()) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self.faults: list = []
        self.inputs = list(inputs)

    async def requests(self):
        for request in self.inputs:
            yield request

    @on("response.output_audio.delta")
    def audio(self, msg):
        self.seen.append(("audio", msg.response_output_audio_delta.response_id))

    @on("session.closed")
    async def closed(self, msg):
        self.seen.append(("closed", msg.session_closed.reason))
        return STOP

    def on_event(self, name, msg):
        self.seen.append(("other", name))

    async def on_fault(self, fault):
        self.faults.append(fault)


def test_handlers_are_declared_by_canonical_names_only():
    assert Recorder.handlers == {"response.output_audio.delta": "audio", "session.closed": "closed"}
    with pytest.raises(ValueError, match="response_output_audio_delta"):
        on("response_output_audio_delta")  # the oneof's name is not the event's


async def test_events_go_to_their_handler_by_canonical_name_and_stop_ends_the_pump():
    stream = Stream([server_event("response.output_audio.delta", response_id="r1", audio=b"\0\0"),
                     server_event("response.done", response_id="r1"),
                     server_event("session.closed", reason="idle_timeout"),
                     server_event("response.created", response_id="r2")])
    door = on_stream(Recorder(), stream)
    await asyncio.wait_for(door.pump_output(), 5)
    assert door.seen == [("audio", "r1"), ("other", "response.done"), ("closed", "idle_timeout")]
    assert door.server_closed and len(stream.events) == 1  # nothing read after STOP


async def test_a_carrier_that_leaves_closes_the_session_by_the_one_rule():
    stream = Stream()
    door = on_stream(Recorder([client_event("input_audio_buffer.append", audio=b"\0\0")]), stream)
    await asyncio.wait_for(door.converse(), 5)
    assert [event_type(r) for r in stream.written] == ["input_audio_buffer.append", "session.close"]
    assert stream.half_closed and stream.was_cancelled
    assert door.seen == [("closed", "client")] and door.server_closed


async def test_the_close_waits_at_most_close_wait_s_for_a_silent_server(monkeypatch):
    monkeypatch.setattr("rtmedia.web.door.CLOSE_WAIT_S", 0.1)
    stream = Stream(answer_close=False)
    door = on_stream(Recorder(), stream)
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(door.converse(), 5)
    assert asyncio.get_running_loop().time() - started < 1.0
    assert stream.was_cancelled and [event_type(r) for r in stream.written] == ["session.close"]
    assert CLOSE_WAIT_S == 2.0


async def test_no_session_close_after_the_servers_own():
    stream = Stream([server_event("session.closed", reason="server_shutdown")])
    door = on_stream(Recorder(), stream)
    await asyncio.wait_for(door.end_session(asyncio.ensure_future(door.pump_output())), 5)
    assert stream.written == [] and door.seen == [("closed", "server_shutdown")]


async def test_a_failed_stream_is_one_fault():
    stream = Stream(fail=grpc.StatusCode.UNAVAILABLE)
    door = on_stream(Recorder(), stream)
    await asyncio.wait_for(door.pump_output(), 5)
    [fault] = door.faults
    assert (fault.kind, fault.details, fault.quiet) == ("unreachable", "broken", False)


@pytest.mark.parametrize(("code", "reason", "closed", "kind", "status", "busy"), [
    (grpc.StatusCode.CANCELLED, "", False, "cancelled", 499, False),
    (grpc.StatusCode.INTERNAL, "", True, "ended", 200, False),
    (grpc.StatusCode.INTERNAL, "", False, "failed", 502, False),
    (grpc.StatusCode.UNAUTHENTICATED, "", False, "unauthenticated", 401, False),
    (grpc.StatusCode.PERMISSION_DENIED, "", False, "forbidden", 403, False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA", False, "quota", 429, True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "AT_CAPACITY", False, "refused", 503, True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "", False, "failed", 502, True),
    (grpc.StatusCode.UNAVAILABLE, "DRAINING", False, "refused", 503, False),
    (grpc.StatusCode.UNAVAILABLE, "", False, "unreachable", 502, False),
])
def test_the_error_mapping(code, reason, closed, kind, status, busy):
    fault = fault_of(RtmediaError(code, "why", reason), server_closed=closed)
    assert (fault.kind, fault.http_status, fault.busy) == (kind, status, busy)
    assert fault.quiet == (kind in ("cancelled", "ended"))


def test_an_open_that_timed_out_is_a_timeout():
    assert fault_of(TimeoutError()).http_status == 504
