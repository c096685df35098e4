"""OpenTelemetry traces (server/observe/tracing.py, docs/operations.md#traces), in-process with the real
engines, the SDK's in-memory exporter behind a SimpleSpanProcessor, and the `openai` responder
on the stand-in chat server (tests/support/chat_upstream.py, the one fake): a spoken session
with a barge-in and a tool call makes the span tree root -> turns -> stages with the attributes
an operator filters on (the token's name, never the token; a call's name, never its
arguments); a client's traceparent is continued by the session's trace and into the upstream
LLM request; the OpenAI Realtime WebSocket forwards its traceparent header."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.server.observe.tracing import Tracing

from tests.support.chat_upstream import Calls, ChatUpstream, tool_results
from tests.support.converse import Conversation

RATE = 24000
TOKEN = "tok-tracing-0123456789-secret"
TOKEN_NAME = "tracer"
SECRET_ARGUMENT = "Zanzibar-argument"  # a call's argument: never in a span
STORY = (
    "Once upon a time a lighthouse keeper lived alone on a rocky island far out at sea. "
    "Every evening he climbed the long spiral stairs to light the great lamp. "
    "Ships passed safely through the dark water because of his steady work. "
    "One stormy night a small boat came too close to the rocks near the shore. "
    "He rowed out through the waves and brought the sailors home to the island."
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
STAGES = {"turn_detection", "transcription", "responder", "first_audio", "tts.clause"}


def script(body: dict) -> list:
    """The weather question calls get_weather; its output is answered; anything else gets a story."""
    if results := tool_results(body):
        return [f"It is {json.loads(results[-1])['sky']} today."]
    last = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
    if "weather" in last.lower():
        return ["Let me check. ", Calls([("get_weather", {"city": SECRET_ARGUMENT})])]
    return [STORY]


class SessionEnds(SpanProcessor):
    """Resolves a future per session (by its id, and by its trace id) when its root span ends."""

    def __init__(self) -> None:
        self.ended: dict[str, asyncio.Future[None]] = {}

    def future(self, session_id: str) -> asyncio.Future[None]:
        return self.ended.setdefault(session_id, asyncio.get_running_loop().create_future())

    def on_end(self, span: ReadableSpan) -> None:
        if span.name == "rtmedia.session":  # by session id and by trace id
            for key in (str(span.attributes["rtmedia.session.id"]), format(span.context.trace_id, "032x")):
                future = self.future(key)
                if not future.done():
                    future.set_result(None)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def session_ends() -> SessionEnds:
    return SessionEnds()


@pytest.fixture(scope="module")
async def upstream():
    async with ChatUpstream(script) as up:
        yield up


@pytest.fixture(scope="module")
async def server(upstream, exporter, session_ends, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    tokens.write_text(f"{TOKEN} {TOKEN_NAME}\n")
    tracing = Tracing(SimpleSpanProcessor(exporter))
    tracing.provider.add_span_processor(session_ends)
    srv = RtmediaServer(
        ServerConfig.of(
            port=0,
            metrics_port=0,
            grace_s=1,
            llm=False,
            default_responder="openai",
            openai_url=upstream.url,
            openai_model="stand-in",
            asr_decoders=2,
            auth_tokens=str(tokens),
        ),
        tracing=tracing,
    )
    await srv.start()
    yield srv
    await srv.stop(0)


def auth(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKEN}"), *extra)


async def trace_of(exporter, session_ends, key: str) -> list[ReadableSpan]:
    """The spans of a session's trace (`key`: its session id or trace id), once its root ended."""
    await asyncio.wait_for(session_ends.future(key), 15)
    [root] = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "rtmedia.session"
        and key in (s.attributes["rtmedia.session.id"], format(s.context.trace_id, "032x"))
    ]
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == root.context.trace_id]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
        key=lambda s: s.start_time,
    )


def spoken(speaker, text: str, lead: float = 0.3, tail: float = 1.0) -> bytes:
    return np.concatenate(
        [speaker.silence(lead, RATE), speaker.say(text, RATE), speaker.silence(tail, RATE)]
    ).tobytes()


async def test_a_session_with_a_barge_in_and_a_tool_call_makes_the_span_tree(
    channel, exporter, session_ends, upstream, speaker
):
    async with Conversation(channel, metadata=auth(("traceparent", TRACEPARENT))) as c:
        created = await c.wait_for("session.created")
        c.send(
            "session.update",
            session={
                "responder": "openai",
                "tool_filler_ms": 0,
                "tools": {"functions": [{"name": "get_weather", "parameters": "{}"}]},
            },
        )
        await c.wait_for("session.updated")
        # Turn 1: a story, cut by turn 2 while it plays.
        await c.stream(spoken(speaker, "Tell me a story about the sea.", tail=0.8), RATE, speed=2.0)
        story = await c.wait_for("response.created", timeout=20)
        await c.wait_for("response.output_audio.delta", timeout=20)
        await asyncio.sleep(0.3)  # (the reply plays: the client's own pace)
        await c.stream(spoken(speaker, "What is the weather like in Paris?", lead=0.2, tail=1.0), RATE)
        await c.wait_for("output_audio_buffer.cleared", response_id=story["response_id"], timeout=10)
        asked = await c.wait_for("response.done", count=2, timeout=30)
        assert asked["status"] == "completed", asked
        [call] = asked["function_calls"]
        c.send(
            "conversation.item.create",
            item={
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": json.dumps({"sky": "sunny"}),
            },
        )
        c.send("response.create")
        answer = await c.wait_for("response.done", count=3, timeout=30)
        assert answer["status"] == "completed"
        c.send("session.close")
        await c.ended()
    spans = await trace_of(exporter, session_ends, created["session_id"])

    [root] = [s for s in spans if s.name == "rtmedia.session"]
    assert root.parent is not None and root.parent.span_id == int(PARENT_ID, 16)  # the client's traceparent
    assert root.context.trace_id == int(TRACE_ID, 16)
    assert (
        root.attributes["rtmedia.token.name"] == TOKEN_NAME
        and root.attributes["rtmedia.responder"] == "openai"
    )
    assert root.attributes["rtmedia.model"] == "stand-in" and root.attributes["rtmedia.session.turns"] == 2
    top = children(spans, root)
    assert [s.name for s in top] == ["rtmedia.turn", "rtmedia.turn", "rtmedia.response"], [
        s.name for s in top
    ]
    first, second, answered = top
    assert all(root.start_time <= s.start_time <= s.end_time <= root.end_time for s in top)

    # Turn 1: the story, cut: its stages, and the barge-in with what was heard.
    stages = {s.name: s for s in children(spans, first)}
    assert STAGES | {"barge_in"} <= stages.keys(), stages.keys()
    barge = stages["barge_in"]
    assert 0 < barge.attributes["rtmedia.heard_ms"] <= barge.attributes["rtmedia.output_audio_ms"]
    assert barge.end_time <= second.start_time + 1_000_000_000  # cut as the user began turn 2
    assert first.attributes["rtmedia.turn.end_reason"] == "silence"
    assert stages["responder"].events[0].name == "first_text"
    clause = next(s for s in children(spans, first) if s.name == "tts.clause")
    assert clause.attributes["rtmedia.tts.text_chars"] > 0 and clause.attributes["rtmedia.tts.audio_ms"] > 0
    # Turn 2: the question, whose reply called get_weather.
    stages = {s.name: s for s in children(spans, second)}
    assert STAGES | {"tool_call"} <= stages.keys(), stages.keys()
    assert stages["tool_call"].attributes["rtmedia.tool.name"] == "get_weather"
    assert second.attributes["rtmedia.response.status"] == "completed"
    assert second.attributes["rtmedia.preemptive"] in ("committed", "none")
    assert second.attributes["rtmedia.timings.voice_to_voice_ms"] >= 0
    # The answer to the call's output: a response of its own (no user turn).
    assert {"responder", "first_audio", "tts.clause"} <= {s.name for s in children(spans, answered)}
    # Times are real: each stage lies within its turn (give or take a millisecond of rounding).
    for turn in (first, second):
        for stage in children(spans, turn):
            # (the user's speech ended, and a barge-in's reply began, before its turn's span)
            if stage.name not in ("barge_in", "turn_detection"):
                assert turn.start_time - 1_000_000 <= stage.start_time, stage.name

    # No token value and no tool argument anywhere.
    everything = json.dumps([{k: str(v) for k, v in s.attributes.items()} for s in spans])
    assert TOKEN not in everything and SECRET_ARGUMENT not in everything
    # The upstream LLM request carried the responder span's traceparent (same trace).
    traced = [h.get("traceparent", "") for h in upstream.headers]
    responders = {format(s.context.span_id, "016x") for s in spans if s.name == "responder"}
    assert any(tp.split("-")[1] == TRACE_ID and tp.split("-")[2] in responders for tp in traced if tp), traced


async def test_a_text_response_continues_the_callers_trace(channel, exporter, session_ends):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with Conversation(channel, metadata=auth(("traceparent", parent))) as c:
        created = await c.wait_for("session.created")
        c.send("session.update", session={"responder": "openai", "output_modality": "text"})
        c.send("conversation.item.create", item={"text": "Hello there."})
        c.send("response.create")
        await c.wait_for("response.done", timeout=20)
        c.send("session.close")
        await c.ended()
    spans = await trace_of(exporter, session_ends, created["session_id"])
    [root] = [s for s in spans if s.name == "rtmedia.session"]
    assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert root.parent is not None and root.parent.span_id == 0xB7AD6B7169203331 and root.parent.is_remote
    assert [s.name for s in children(spans, root)] == ["rtmedia.response"]


async def test_other_rpcs_get_a_server_span(channel, exporter):
    from rtmedia.v1 import speech_pb2, speech_pb2_grpc

    parent = "00-11111111111111111111111111111111-2222222222222222-01"
    stub = speech_pb2_grpc.SpeechServiceStub(channel)
    await stub.ListVoices(speech_pb2.ListVoicesRequest(), metadata=auth(("traceparent", parent)))
    [span] = [s for s in exporter.get_finished_spans() if s.context.trace_id == int("1" * 32, 16)]
    assert span.name == "rtmedia.v1.SpeechService/ListVoices" and span.parent.span_id == int("2" * 16, 16)


async def test_the_openai_realtime_socket_forwards_traceparent(web_front, exporter, session_ends):
    parent = "00-33333333333333333333333333333333-4444444444444444-01"
    url = f"ws://127.0.0.1:{web_front.port}/v1/realtime?model=gpt-realtime"
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(
            url, headers={"traceparent": parent, "Authorization": f"Bearer {TOKEN}"}
        ) as ws:
            created = json.loads((await ws.receive()).data)
            assert created["type"] == "session.created"
    spans = await trace_of(exporter, session_ends, "3" * 32)
    [root] = [s for s in spans if s.name == "rtmedia.session"]
    assert root.context.trace_id == int("3" * 32, 16) and root.parent.span_id == int("4" * 16, 16)
    assert root.attributes["rtmedia.transport"] == "openai-ws"
