"""What a hostile client meets on the gRPC port: a request that does not decode ends its call
with INVALID_ARGUMENT (UNDECODABLE_REQUEST) on every kind of method, at once and freeing the
session, and is logged without a traceback and not once per request; a client that does not
read is warned, then closed, holding no more than the outbox bounds; what the server would
echo is bounded; a truncate stops the reply; commits and response settings are checked."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from rtmedia.protocol.errors import error_reason
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2_grpc

from tests.support.converse import Conversation
from tests.support.waits import metric, metric_at_least, until

# Small session bounds, so that a test reaches them quickly.
SERVER_OPTIONS = {"session_outbox_events": 64, "session_outbox_bytes": 64 * 1024, "session_id_bytes": 64,
                  "session_instructions_chars": 100}

GARBAGE = b"\xff\xff\xff\xff\x0f"  # a field header whose varint never ends


async def call_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 10)
    return info.value


async def test_undecodable_converse_request_ends_the_stream_and_frees_the_session(server, channel, caplog):
    converse = channel.stream_stream("/rtmedia.v1.RealtimeService/Converse", request_serializer=None,
                                     response_deserializer=None)
    good = client_event("session.update", session={}).SerializeToString()
    call = converse(iter([good, GARBAGE]))
    with caplog.at_level(logging.WARNING, logger="rtmedia.rpc"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async def drain() -> None:
                async for _ in call:
                    pass
            await asyncio.wait_for(drain(), 10)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(error) == "UNDECODABLE_REQUEST"
    assert "request 2 of Converse" in error.details() and "ConverseRequest" in error.details()
    await until(lambda: not server.realtime.sessions, what="the session's slot free again")
    assert not server.realtime.sessions, "the session's slot is free again"
    records = [r for r in caplog.records if r.getMessage() == "undecodable request"]
    assert len(records) == 1 and records[0].exc_info is None


async def test_a_session_ended_by_an_undecodable_request_is_logged_with_that_reason(channel):
    """The session's end is logged with what ended it, the undecodable request, not as a
    cancellation (the call's own cancellation is how the servicer learns of it)."""
    opened: list[str] = []
    closed: dict[str, str] = {}
    logged = asyncio.Event()

    class Sessions(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "session opened":
                opened.append(record.session_id)  # type: ignore[attr-defined]
            elif record.getMessage() == "session closed":
                closed[record.session_id] = record.reason  # type: ignore[attr-defined]
            logged.set()

    logger = logging.getLogger("rtmedia.server.services.realtime")
    handler, level = Sessions(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        converse = channel.stream_stream("/rtmedia.v1.RealtimeService/Converse", request_serializer=None,
                                         response_deserializer=None)
        call = converse(iter([client_event("session.update", session={}).SerializeToString(), GARBAGE]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert error_reason(info.value) == "UNDECODABLE_REQUEST"
        while not (opened and opened[0] in closed):
            logged.clear()
            await asyncio.wait_for(logged.wait(), 10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert len(opened) == 1 and closed[opened[0]] == "undecodable_request", (opened, closed)


@pytest.mark.parametrize("method, kind", [
    ("/rtmedia.v1.SpeechService/Synthesize", "unary_stream"),
    ("/rtmedia.v1.SpeechService/ListVoices", "unary_unary"),
    ("/rtmedia.v1.SpeechService/Transcribe", "stream_stream"),
    ("/rtmedia.v1.VideoService/DecodeVideo", "unary_stream"),
    ("/nvidia.riva.asr.RivaSpeechRecognition/StreamingRecognize", "stream_stream"),
    ("/nvidia.riva.tts.RivaSpeechSynthesis/SynthesizeOnline", "stream_stream"),
])
async def test_every_method_answers_an_undecodable_request_with_invalid_argument(channel, method, kind):
    factory = getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)
    if kind.startswith("stream"):
        call = factory(iter([GARBAGE]))
    else:
        call = factory(GARBAGE)

    async def finish() -> None:
        if kind.endswith("stream"):
            async for _ in call:
                pass
        else:
            await call

    error = await call_error(finish())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error_reason(error) == "UNDECODABLE_REQUEST"


async def test_a_flood_of_undecodable_requests_logs_once_per_peer(channel, caplog):
    synthesize = channel.unary_stream("/rtmedia.v1.SpeechService/Synthesize", request_serializer=None,
                                      response_deserializer=None)

    async def one() -> None:
        async for _ in synthesize(GARBAGE):
            pass

    with caplog.at_level(logging.WARNING, logger="rtmedia.rpc"):
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError):
                await one()
    assert len([r for r in caplog.records if r.getMessage() == "undecodable request"]) <= 1


async def test_a_client_that_does_not_read_is_warned_then_closed(server):
    """Each response.cancel with nothing to cancel is answered by an error echoing its id; a
    client that never reads (its channel reads nothing ahead of the application) fills its
    outbox, gets client_too_slow, and the session ends at once, whatever it goes on sending;
    the stream's status, RESOURCE_EXHAUSTED (CLIENT_TOO_SLOW), follows what it finally reads."""
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        stub = realtime_pb2_grpc.RealtimeServiceStub(channel)

        ended = asyncio.Event()  # the server ended the session: the client half-closes then, or
        # under load gRPC may report its own failed write (INTERNAL) instead of the call's status

        async def requests():
            for n in range(20000):
                if ended.is_set():
                    return
                yield client_event("response.cancel", event_id=f"{n:060d}")
                if n % 200 == 0:
                    await asyncio.sleep(0)

        failed = metric(server, "rtmedia_sessions_total", outcome="failed") or 0
        call = stub.Converse(requests())
        await metric_at_least(server, "rtmedia_sessions_total", failed + 1, outcome="failed")
        assert not server.realtime.sessions, "the session and its slot are gone before the client reads"
        ended.set()
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for event in call:
                events.append(event)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_reason(info.value) == "CLIENT_TOO_SLOW"
    # its warning went to the outbox it never read down; what it does get is the status
    assert [e.error.code for e in events if e.WhichOneof("event") == "error"].count("client_too_slow") <= 1
    assert len(events) < 200, "what was kept for it was bounded"


async def test_what_the_server_would_echo_is_bounded(channel):
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        c.send("response.cancel", event_id="x" * 65)
        long_id = await c.wait_for("error", param="event_id")
        assert long_id["event_id"] == "" and "event_id is 65 bytes; the limit is 64" in long_id["message"]
        c.send("playback.ack", event_id="ack1", response_id="r" * 100, played_ms=0)
        ack = await c.wait_for("error", param="response_id")
        assert ack["event_id"] == "ack1" and "r" * 65 not in ack["message"]
        c.send("session.update", event_id="v", session={"voice": "v" * 300})
        voice = await c.wait_for("error", event_id="v")
        assert voice["param"] == "voice" and "v" * 65 not in voice["message"]
        c.send("session.update", event_id="i", session={"instructions": "be brief. " * 11})
        instructions = await c.wait_for("error", event_id="i")
        assert instructions["param"] == "instructions" and "limit is 100" in instructions["message"]
        c.send("conversation.item.create", item={"text": "hello"})
        c.send("response.create", event_id="n", max_output_tokens=-5)
        tokens = await c.wait_for("error", event_id="n")
        assert tokens["param"] == "max_output_tokens"
        c.send("response.create", event_id="j", instructions="x" * 101)
        assert (await c.wait_for("error", event_id="j"))["param"] == "instructions"
        assert not c.of_type("response.created"), "refused requests start nothing"


async def test_a_second_commit_with_nothing_new_is_refused(channel):
    """...after the first one is answered: answers follow the order of the client events."""
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        c.send("session.update", session={"turn_detection": {"type": "manual"}})
        await c.wait_for("session.updated")
        c.send("input_audio_buffer.append", audio=b"\0\0" * 4800)
        c.send("input_audio_buffer.commit", event_id="first")
        c.send("input_audio_buffer.commit", event_id="second")
        error = await c.wait_for("error", event_id="second")
        assert error["code"] == "input_audio_buffer_commit_empty"
        assert c.types().index("input_audio_buffer.committed") < c.events.index(error), c.types()
        await asyncio.sleep(0.3)
        assert len(c.of_type("input_audio_buffer.committed")) == 1


async def test_a_truncate_during_a_reply_ends_it_with_what_was_heard(channel):
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        c.send("conversation.item.create", item={"text": "one two three four five six seven eight nine ten "
                                                          "eleven twelve thirteen fourteen fifteen"})
        c.send("response.create")
        created = await c.wait_for("response.created")
        await c.wait_for("response.output_audio.delta")
        c.send("conversation.item.truncate", item_id=created["item_id"], audio_end_ms=0)
        done = await c.wait_for("response.done", timeout=10)
        assert done["status"] == "cancelled" and done["status_reason"] == "client_truncated"
        c.send("conversation.item.create", item={"text": "again"})
        c.send("response.create")
        await c.wait_for("response.done", count=2, timeout=20)
