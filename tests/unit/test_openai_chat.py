"""The `openai` responder against a chat-completions server started here: streamed deltas, the
request it sends, a reply cut by the token limit (finish_reason "length") ending with Incomplete,
every failure as a ResponderError naming the URL, and cancellation mid-stream closing the
connection (the server sees the client go away)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from rtmedia.engines.lm.models import DEFAULT_INSTRUCTIONS
from rtmedia.engines.responders.contract import (
    NO_RESULT,
    CallDelta,
    FunctionCall,
    FunctionTool,
    Incomplete,
    Message,
    ReplyRequest,
    chat_messages,
)
from rtmedia.engines.responders.contract import ResponderError as BaseResponderError
from rtmedia.engines.responders.openai_chat import OpenAIResponder, ResponderError

REPLY = "Paris is the capital of France, and it is lovely in spring."


@dataclass
class FakeServer:
    """`POST /v1/chat/completions`; the request's `model` picks the behaviour."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        mode = body["model"]
        if mode == "error500":
            return web.json_response({"error": {"message": "the model exploded", "type": "server_error"}},
                                     status=500)
        if mode == "error401":
            return web.json_response({"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}},
                                     status=401)
        if mode == "plain404":
            return web.Response(status=404, text="no such route here")
        if mode == "nonstream":
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": REPLY}}]})
        if mode == "nonstream-length":
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "Paris is"},
                                                   "finish_reason": "length"}]})
        if mode == "slow":  # says nothing until the client gives up
            for _ in range(250):  # at most 5 s
                if request.transport is None or request.transport.is_closing():
                    break
                await asyncio.sleep(0.02)
            self.client_gone.set()
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(data: str) -> None:
            await response.write(f"data: {data}\n\n".encode())

        if mode == "malformed":
            await send(json.dumps(chunk("Hello ")))
            await send("{not json")
        elif mode == "error-event":
            await send(json.dumps(chunk("Hello ")))
            await send(json.dumps({"error": {"message": "out of GPU memory"}}))
        elif mode == "truncated":  # the connection ends without [DONE] or a finish_reason
            await send(json.dumps(chunk("Hello ")))
        elif mode == "finish-no-done":
            await send(json.dumps(chunk("Hello.")))
            await send(json.dumps({"choices": [{"delta": {}, "index": 0, "finish_reason": "stop"}]}))
        elif mode in ("length", "length-no-done"):  # the token limit ended the reply
            await send(json.dumps(chunk("Paris ")))
            await send(json.dumps({"choices": [{"delta": {"content": "is"}, "index": 0, "finish_reason": "length"}]}))
            if mode == "length":
                await send(json.dumps({"choices": [], "usage": {"completion_tokens": 2}}))
                await send("[DONE]")
        elif mode == "variety":  # a comment, a role-only delta, a multi-line event, a usage chunk
            await response.write(b": keep-alive\n\n")
            await send(json.dumps({"choices": [{"delta": {"role": "assistant"}, "index": 0}]}))
            await response.write(b'event: message\ndata: {"choices": [{"delta":\r\ndata: {"content": "Hi "}}]}\r\n\r\n')
            await send(json.dumps(chunk("there.")))
            await send(json.dumps({"choices": [], "usage": {"completion_tokens": 2}}))
            await send("[DONE]")
        elif mode == "endless":  # a word every 20 ms for 10 s, unless the client goes away
            try:
                for n in range(500):
                    await send(json.dumps(chunk(f"w{n} ")))
                    await asyncio.sleep(0.02)
            except ConnectionError:
                self.client_gone.set()
            finally:
                self.client_gone.set()
            return response
        else:
            for word in words(REPLY):
                await send(json.dumps(chunk(word)))
                await asyncio.sleep(0.001)
            await send("[DONE]")
        await response.write_eof()
        return response


def chunk(text: str) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "choices": [{"delta": {"content": text}, "index": 0}]}


def words(text: str) -> list[str]:
    parts = text.split(" ")
    return [w + " " for w in parts[:-1]] + [parts[-1]]


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}/v1"
    yield fake
    await runner.cleanup()


def request(history: list[Message] | None = None, **kw: Any) -> ReplyRequest:
    return ReplyRequest(history=history or [Message("user", "What is the capital of France?")], **kw)


async def collect(responder: OpenAIResponder, req: ReplyRequest) -> list[str]:
    return [delta async for delta in responder.reply(req)]


async def test_streams_the_reply_and_sends_the_conversation(server: FakeServer) -> None:
    history = [Message("user", "Hello"), Message("assistant", "Hi, how can I help?"),
               Message("user", "What is the capital of France?")]
    responder = OpenAIResponder(server.url, "ok", api_key="sk-test")
    deltas = await collect(responder, request(history, instructions="Answer briefly.", max_output_tokens=42))
    assert deltas == words(REPLY) and "".join(deltas) == REPLY
    body = server.requests[-1]
    assert body["model"] == "ok" and body["stream"] is True and body["max_tokens"] == 42
    assert body["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert server.headers[-1]["Authorization"] == "Bearer sk-test"
    assert responder.name == "openai"


async def test_defaults_no_key_no_max_tokens_default_instructions(server: FakeServer) -> None:
    responder = OpenAIResponder(server.url + "/", "ok")  # a trailing slash is fine
    assert "".join(await collect(responder, request())) == REPLY
    body = server.requests[-1]
    assert "max_tokens" not in body
    assert body["messages"][0] == {"role": "system", "content": DEFAULT_INSTRUCTIONS}
    assert "Authorization" not in server.headers[-1]


async def test_images_go_with_the_last_user_turn(server: FakeServer) -> None:
    jpeg, png = b"\xff\xd8\xff\xe0fake-jpeg", b"\x89PNG\r\n\x1a\nfake-png"
    history = [Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "What do you see?")]
    await collect(OpenAIResponder(server.url, "ok"), request(history, images=[jpeg, png]))
    messages = server.requests[-1]["messages"]
    assert messages[1] == {"role": "user", "content": "Hi"}
    assert messages[-1]["content"] == [
        {"type": "text", "text": "What do you see?"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
    ]
    await collect(OpenAIResponder(server.url, "ok", send_images=False), request(history, images=[jpeg]))
    assert server.requests[-1]["messages"][-1] == {"role": "user", "content": "What do you see?"}


async def test_the_token_limit_ends_the_reply_with_incomplete(server: FakeServer) -> None:
    for mode in ("length", "length-no-done", "nonstream-length"):
        deltas = await collect(OpenAIResponder(server.url, mode), request(max_output_tokens=2))
        assert "".join(d for d in deltas if isinstance(d, str)) == "Paris is", mode
        assert deltas[-1] == Incomplete("max_output_tokens"), mode
    assert not any(isinstance(d, Incomplete) for d in await collect(OpenAIResponder(server.url, "ok"), request()))


async def test_sse_variety_and_a_non_streaming_server(server: FakeServer) -> None:
    assert await collect(OpenAIResponder(server.url, "variety"), request()) == ["Hi ", "there."]
    assert await collect(OpenAIResponder(server.url, "finish-no-done"), request()) == ["Hello."]
    assert await collect(OpenAIResponder(server.url, "nonstream"), request()) == [REPLY]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("error500", ["HTTP 500", "the model exploded"]),
        ("error401", ["HTTP 401", "Incorrect API key provided"]),
        ("plain404", ["HTTP 404", "no such route here"]),
        ("malformed", ["malformed stream event", "{not json"]),
        ("error-event", ["error mid-stream", "out of GPU memory"]),
        ("truncated", ["stream ended before"]),
    ],
)
async def test_server_errors(server: FakeServer, mode: str, expected: list[str]) -> None:
    got: list[str] = []
    with pytest.raises(ResponderError) as info:
        async for delta in OpenAIResponder(server.url, mode).reply(request()):
            got.append(delta)
    message = str(info.value)
    assert server.url + "/chat/completions" in message
    for text in expected:
        assert text in message
    if mode in ("malformed", "error-event"):
        assert got == ["Hello "]  # what came before the bad event was already streamed
    assert isinstance(info.value, BaseResponderError) and isinstance(info.value, RuntimeError)


async def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(ResponderError, match="cannot connect") as info:
        await collect(OpenAIResponder(url, "ok"), request())
    assert f"{url}/chat/completions" in str(info.value)


async def test_timeout_waiting_for_the_server(server: FakeServer) -> None:
    server.client_gone.clear()
    t0 = time.perf_counter()
    with pytest.raises(ResponderError, match=r"no response within 0\.3 s"):
        await collect(OpenAIResponder(server.url, "slow", timeout_s=0.3), request())
    assert time.perf_counter() - t0 < 2
    await asyncio.wait_for(server.client_gone.wait(), 2)


async def test_cancel_mid_stream_closes_the_connection(server: FakeServer) -> None:
    server.client_gone.clear()
    got: list[str] = []
    three = asyncio.Event()

    async def consume() -> None:
        async for delta in OpenAIResponder(server.url, "endless").reply(request()):
            got.append(delta)
            if len(got) == 3:
                three.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(three.wait(), 5)
    t0 = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - t0 < 0.5  # the consumer is released at once
    await asyncio.wait_for(server.client_gone.wait(), 2)  # and the server sees the client go away
    assert time.perf_counter() - t0 < 2
    assert got[:3] == ["w0 ", "w1 ", "w2 "] and len(got) < 50


# ---- tools ---------------------------------------------------------------------------------------
WEATHER = FunctionTool("get_weather", "The weather.", {"type": "object", "properties": {"city": {"type": "string"}}})


def test_the_history_groups_calls_with_their_reply_and_outputs_follow_each_call():
    call_a, call_b = FunctionCall("call_1", "get_weather", '{"city": "Paris"}'), FunctionCall("call_2", "t", "{}")
    history = [Message("user", "weather?"), Message("assistant", "Let me look.", "i1"),
               Message("assistant", "", "i2", call=call_a), Message("assistant", "", "i3", call=call_b),
               Message("user", "hurry up"), Message("tool", "sunny", "i4", call_id="call_1"),
               Message("tool", "orphan", "i5", call_id="call_gone"), Message("assistant", "", "i6",
                                                                             call=FunctionCall("call_3", "t", "{}"))]
    assert chat_messages(history) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},  # moved up to its call
        {"role": "tool", "tool_call_id": "call_2", "content": NO_RESULT},  # not answered (yet)
        {"role": "user", "content": "hurry up"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": NO_RESULT},
    ]


def test_the_body_carries_the_tools_and_the_choice():
    responder = OpenAIResponder("http://h/v1", "m")
    body = responder.body(request(tools=(WEATHER,), tool_choice="get_weather"))
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                                               "parameters": WEATHER.parameters}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert responder.body(request(tools=(WEATHER,), tool_choice="required"))["tool_choice"] == "required"
    assert "tools" not in responder.body(request()) and "tool_choice" not in responder.body(request())


async def test_streamed_and_whole_tool_calls_become_call_deltas():
    from tests.support.chat_upstream import Calls, ChatUpstream

    async with ChatUpstream(lambda body: ["Checking. ", Calls([("get_weather", {"city": "Paris"}), ("t", {})])]) as up:
        out = await collect(OpenAIResponder(up.url, "m"), request(tools=(WEATHER,)))
    assert out[0] == "Checking. "
    calls: dict[int, list[str]] = {}
    for delta in out[1:]:
        assert isinstance(delta, CallDelta)
        calls.setdefault(delta.index, [delta.name, ""])[1] += delta.arguments
    assert calls == {0: ["get_weather", '{"city": "Paris"}'], 1: ["t", "{}"]}
    assert len([d for d in out[1:] if d.index == 0]) > 2, "the arguments came in pieces"


async def test_malformed_tool_calls_are_a_responder_error(server: FakeServer) -> None:
    responder = OpenAIResponder(server.url, "m")
    for bad in ({"tool_calls": {"index": 0}}, {"tool_calls": [{"index": 0, "function": "x"}]},
                {"tool_calls": [{"index": "0", "function": {}}]}):
        with pytest.raises(ResponderError, match="tool"):
            responder._handle({"choices": [{"delta": bad}]})
