"""Function calls in a Converse session (docs/protocol.md#tools), on the `openai` responder
against a stand-in chat-completions server (tests/support/chat_upstream.py, the one fake):
a call streamed out, the client's output, the spoken answer; parallel calls; tool_choice;
a user who speaks on while a call is out; the filler and the timeout; the refusals; and the
same through OpenAI's Realtime API with the `openai` SDK."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
from rtmedia.engines.responders.contract import NO_RESULT
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.server.session.limits import Limits

from tests.support.chat_upstream import Calls, ChatUpstream, tool_results
from tests.support.converse import Conversation

RATE = 16000
WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
           "parameters": json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]})}
TIME = {"name": "get_time", "description": "The time in a city.",
        "parameters": json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})}
NO_FILLER = {"tool_filler_ms": 0}


def script(body: dict) -> list:
    """Calls get_weather (and get_time when asked about time) until the outputs are in, then
    answers with them; with tool_choice none, or a call left unanswered, answers at once."""
    if body.get("tool_choice") == "none" or "tools" not in body:
        return ["I cannot look that up."]
    results = tool_results(body)
    if NO_RESULT in results:  # the user moved on
        return ["All right."]
    if results:
        return ["The answer is ", " and ".join(results), "."]
    last = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
    calls = [("get_weather", {"city": "Paris"})]
    if "time" in last:
        calls.append(("get_time", {"city": "Paris"}))
    return ["Let me check. ", Calls(calls)] if "check" in last else [Calls(calls)]


@pytest.fixture(scope="module")
async def upstream():
    async with ChatUpstream(script) as up:
        yield up


@pytest.fixture(scope="module")
async def served(upstream):
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1, llm=False, default_responder="openai",
                                        openai_url=upstream.url, openai_model="stand-in"))
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, channel
    await server.stop(0)


async def session(channel, **config) -> Conversation:
    c = await Conversation(channel).__aenter__()
    c.send("session.update", session={"responder": "openai", "tools": {"functions": [WEATHER, TIME]},
                                      "turn_detection": {"type": "manual"}, **config})
    await c.wait_for("session.updated")
    return c


def ask(c: Conversation, text: str) -> None:
    c.send("conversation.item.create", item={"text": text})
    c.send("response.create")


async def test_a_call_is_streamed_answered_and_the_answer_uses_its_output(served, upstream):
    _, channel = served
    c = await session(channel, **NO_FILLER)
    try:
        ask(c, "Please check the weather in Paris")
        done = await c.wait_for("response.done", timeout=30)
        assert done["status"] == "completed"
        [call] = done["function_calls"]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        added = c.of_type("response.output_item.added")
        assert [a["item"]["call_id"] for a in added] == [call["call_id"]] and added[0]["output_index"] == 1
        deltas = [e["delta"] for e in c.of_type("response.function_call_arguments.delta")]
        assert len(deltas) >= 2 and "".join(deltas) == call["arguments"]  # streamed in pieces
        assert c.of_type("response.function_call_arguments.done")[0]["arguments"] == call["arguments"]
        assert c.of_type("response.output_item.done")[0]["item"] == call
        # the text before the call is spoken, the call is not
        assert c.of_type("response.output_text.done")[0]["text"] == "Let me check."
        assert c.of_type("response.output_audio.delta")

        c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": json.dumps({"temperature_c": 21})})
        added = await c.wait_for("conversation.item.added", count=2)  # after the question's
        assert added["item"]["type"] == "function_call_output" and added["item"]["call_id"] == call["call_id"]
        c.send("response.create")
        answer = await c.wait_for("response.done", count=2, timeout=30)
        assert answer["status"] == "completed" and not answer.get("function_calls")
        text = c.of_type("response.output_text.done")[-1]["text"]
        assert "21" in text
        assert [e for e in c.of_type("response.output_audio.delta") if e["response_id"] == answer["response_id"]]
        messages = upstream.bodies[-1]["messages"]
        assistant = next(m for m in messages if m.get("tool_calls"))
        assert assistant["content"] == "Let me check."
        assert assistant["tool_calls"][0]["id"] == call["call_id"]
        assert messages[messages.index(assistant) + 1] == {"role": "tool", "tool_call_id": call["call_id"],
                                                           "content": json.dumps({"temperature_c": 21})}
        assert upstream.bodies[-1]["tools"][0]["function"]["name"] == "get_weather"
    finally:
        await c.__aexit__(None, None, None)


async def test_two_parallel_calls_each_have_their_own_call_id(served, upstream):
    _, channel = served
    c = await session(channel, **NO_FILLER)
    try:
        ask(c, "weather and time in Paris")
        done = await c.wait_for("response.done", timeout=30)
        calls = done["function_calls"]
        assert [x["name"] for x in calls] == ["get_weather", "get_time"]
        assert len({x["call_id"] for x in calls}) == 2
        assert [a["output_index"] for a in c.of_type("response.output_item.added")] == [1, 2]
        for x, output in zip(calls, ("sunny", "noon"), strict=True):
            c.send("conversation.item.create", item={"type": "function_call_output", "call_id": x["call_id"],
                                                     "output": output})
        c.send("response.create")
        await c.wait_for("response.done", count=2, timeout=30)
        assert c.of_type("response.output_text.done")[-1]["text"] == "The answer is sunny and noon."
        assert tool_results(upstream.bodies[-1]) == ["sunny", "noon"]
    finally:
        await c.__aexit__(None, None, None)


async def test_tool_choice_none_and_a_named_function_reach_the_upstream(served, upstream):
    _, channel = served
    c = await session(channel, tool_choice={"mode": "none"}, **NO_FILLER)
    try:
        ask(c, "weather in Paris")
        done = await c.wait_for("response.done", timeout=30)
        assert not done.get("function_calls")
        assert upstream.bodies[-1]["tool_choice"] == "none"
        c.send("session.update", session={"tool_choice": {"mode": "function", "name": "get_time"}})
        await c.wait_for("session.updated", count=2)
        ask(c, "and now?")
        await c.wait_for("response.done", count=2, timeout=30)
        assert upstream.bodies[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    finally:
        await c.__aexit__(None, None, None)


async def test_a_user_who_speaks_on_is_answered_and_the_late_output_is_kept(served, upstream):
    _, channel = served
    c = await session(channel, **NO_FILLER)
    try:
        ask(c, "weather in Paris")
        [call] = (await c.wait_for("response.done", timeout=30))["function_calls"]
        ask(c, "never mind that")  # the user moves on: answered as usual
        await c.wait_for("response.done", count=2, timeout=30)
        body = upstream.bodies[-1]
        assert tool_results(body) == [NO_RESULT]  # the call stays, answered for now by the note
        assert body["messages"][-1] == {"role": "user", "content": "never mind that"}
        c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": "rain"})
        added = await c.wait_for("conversation.item.added", count=3)
        assert added["item"]["output"] == "rain"
        assert not c.of_type("error")
    finally:
        await c.__aexit__(None, None, None)


async def test_the_filler_is_spoken_and_cut_when_the_answer_starts(served):
    _, channel = served
    c = await session(channel, tool_filler_ms=100)
    try:
        ask(c, "weather in Paris")
        [call] = (await c.wait_for("response.done", timeout=30))["function_calls"]
        filler = await c.wait_for("response.created", count=2, timeout=10)
        assert filler["filler"] is True and not filler["request_event_id"]
        await c.wait_for("response.output_audio.delta", response_id=filler["response_id"], timeout=15)
        c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": "sunny"})
        c.send("response.create")
        cut = await c.wait_for("response.done", response_id=filler["response_id"], timeout=15)
        # cut: mid-generation (cancelled) or, a short filler being all sent, mid-playback (cleared)
        assert cut["status"] == "completed" or cut["status_reason"] == "answer_started"
        await c.wait_for("output_audio_buffer.cleared", response_id=filler["response_id"], timeout=10)
        answer = await c.wait_for("response.created", count=3, timeout=10)
        assert answer["filler"] is False
        await c.wait_for("response.done", response_id=answer["response_id"], timeout=30)
        assert c.of_type("response.output_text.done")[-1]["text"] == "The answer is sunny."
        assert not c.of_type("error")
    finally:
        await c.__aexit__(None, None, None)


async def test_cancelling_the_filler_keeps_the_wait_and_a_late_output_is_taken(served):
    _, channel = served
    c = await session(channel, tool_filler_ms=100, tool_timeout_ms=30000)
    try:
        ask(c, "weather in Paris")
        [call] = (await c.wait_for("response.done", timeout=30))["function_calls"]
        filler = await c.wait_for("response.created", count=2, timeout=10)
        c.send("response.cancel")
        done = await c.wait_for("response.done", response_id=filler["response_id"], timeout=10)
        assert done["status"] in ("cancelled", "completed")
        c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": "sunny"})
        await c.wait_for("conversation.item.added", count=2)
        c.send("response.create")
        await c.wait_for("response.done", count=3, timeout=30)
        assert c.of_type("response.output_text.done")[-1]["text"] == "The answer is sunny."
    finally:
        await c.__aexit__(None, None, None)


async def test_an_unanswered_call_times_out_with_a_spoken_apology(served, upstream):
    _, channel = served
    c = await session(channel, tool_timeout_ms=1000, **NO_FILLER)
    try:
        ask(c, "weather in Paris")
        await c.wait_for("response.done", timeout=30)
        apology = await c.wait_for("response.done", count=2, timeout=10)
        assert apology["status"] == "completed" and apology["status_reason"] == "tool_timeout"
        assert c.of_type("response.output_text.done")[-1]["text"] == Limits().tool_apology
        assert [e for e in c.of_type("response.output_audio.delta") if e["response_id"] == apology["response_id"]]
        ask(c, "thanks")  # the apology is in the history
        await c.wait_for("response.done", count=3, timeout=30)
        assert any(m["content"] == Limits().tool_apology for m in upstream.bodies[-1]["messages"])
    finally:
        await c.__aexit__(None, None, None)


async def test_outputs_for_unknown_or_answered_calls_are_errors(served):
    _, channel = served
    c = await session(channel, **NO_FILLER)
    try:
        c.send("conversation.item.create", event_id="e1", item={"type": "function_call_output", "call_id": "nope",
                                                                "output": "x"})
        error = await c.wait_for("error")
        assert error["event_id"] == "e1" and error["param"] == "item.call_id" and "nope" in error["message"]
        ask(c, "weather in Paris")
        [call] = (await c.wait_for("response.done", timeout=30))["function_calls"]
        for _ in range(2):
            c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                     "output": "x"})
        error = await c.wait_for("error", count=2)
        assert "already has its output" in error["message"]
        c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": "x", "text": "both"})
        assert (await c.wait_for("error", count=3))["param"] == "item.text"
    finally:
        await c.__aexit__(None, None, None)


@pytest.mark.parametrize(("tools", "param", "part"), [
    ({"functions": [{"name": "bad name"}]}, "tools.functions[0].name", "letters, digits"),
    ({"functions": [{"name": "f", "parameters": "{not json"}]}, "tools.functions[0].parameters", "not JSON"),
    ({"functions": [{"name": "f", "parameters": '{"type": "string"}'}]}, "tools.functions[0].parameters", "object"),
    ({"functions": [{"name": "f"}, {"name": "f"}]}, "tools.functions[1].name", "twice"),
])
async def test_bad_tool_declarations_are_refused_naming_the_field(served, tools, param, part):
    _, channel = served
    async with Conversation(channel) as c:
        c.send("session.update", session={"responder": "openai", "tools": tools})
        error = await c.wait_for("error")
        assert error["param"] == param and part in error["message"]


async def test_tools_on_a_responder_that_cannot_call_them_are_refused(served):
    _, channel = served
    async with Conversation(channel) as c:
        c.send("session.update", session={"responder": "echo", "tools": {"functions": [WEATHER]}})
        error = await c.wait_for("error")
        assert error["param"] == "tools" and "echo" in error["message"] and "openai" in error["message"]
        c.send("session.update", session={"responder": "openai", "tool_choice": {"mode": "function", "name": "x"}})
        error = await c.wait_for("error", count=2)
        assert error["param"] == "tool_choice.name"
        c.send("session.update", session={"responder": "echo"})  # the session goes on without tools
        updated = await c.wait_for("session.updated")
        assert updated["session"]["tools"] == {"functions": []}


async def test_a_spoken_question_gets_a_call(served, speaker):
    _, channel = served
    c = await Conversation(channel).__aenter__()
    try:
        c.send("session.update", session={"responder": "openai", "tools": {"functions": [WEATHER]},
                                          "input_audio_format": {"encoding": "pcm16", "sample_rate": RATE},
                                          **NO_FILLER})
        pcm = np.concatenate([speaker.silence(0.5, RATE), speaker.say("What is the weather like in Paris?", RATE),
                              speaker.silence(1.2, RATE)]).tobytes()
        await c.stream(pcm, RATE, speed=2.0)
        done = await c.wait_for("response.done", timeout=30)
        assert "get_weather" in [x["name"] for x in done["function_calls"]]
        assert c.of_type("conversation.item.input_audio_transcription.completed")[0]["transcript"]
    finally:
        await c.__aexit__(None, None, None)


@pytest.fixture(scope="module")
async def front(served):
    from rtmedia.web.bridge import Bridge, BridgeConfig

    server, _ = served
    bridge = Bridge(BridgeConfig(target=f"127.0.0.1:{server.port}", port=0))
    await bridge.start()
    yield bridge
    await bridge.stop()


async def test_the_realtime_api_calls_a_function_and_answers_with_its_output(front, upstream):
    import openai

    api_weather = {"type": "function", "name": "get_weather", "description": WEATHER["description"],
                   "parameters": json.loads(WEATHER["parameters"])}
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="k", max_retries=0) as client:
        async with client.realtime.connect(model="gpt-realtime") as conn:
            events: list = []

            async def until(kind: str, timeout: float = 30.0):
                async def run():
                    while True:
                        events.append(event := await conn.recv())
                        if event.type == kind:
                            return event
                return await asyncio.wait_for(run(), timeout)

            await until("session.created")
            await conn.session.update(session={"type": "realtime", "tools": [api_weather], "tool_choice": "auto",
                                               "output_modalities": ["text"],
                                               "audio": {"input": {"turn_detection": None}}})
            updated = await until("session.updated")
            assert updated.session.tools[0].name == "get_weather" and updated.session.tool_choice == "auto"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Please check the weather in Paris"}]})
            await conn.response.create()
            done = await until("response.done")
            assert done.response.status == "completed"
            call = next(item for item in done.response.output if item.type == "function_call")
            assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
            kinds = [e.type for e in events]
            assert kinds.count("response.function_call_arguments.delta") >= 2
            args_done = next(e for e in events if e.type == "response.function_call_arguments.done")
            assert (args_done.call_id, args_done.arguments) == (call.call_id, call.arguments)
            added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
            assert added[0].output_index == 1 and added[0].item.call_id == call.call_id

            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": json.dumps({"temperature_c": 21})})
            output = await until("conversation.item.added")
            while output.item.type != "function_call_output":
                output = await until("conversation.item.added")
            assert output.item.call_id == call.call_id
            await conn.response.create()
            answer = await until("response.done")
            text = answer.response.output[0].content[0].text
            assert "21" in text and not [i for i in answer.response.output if i.type == "function_call"]
            assert not [e for e in events if e.type == "error"]
            filler_off = [e for e in events if e.type == "response.created"]
            assert len(filler_off) == 2, "no filler on the OpenAI API unless the session asks"


async def test_a_barge_in_on_the_filler_cancels_it_only_and_the_turn_is_answered(served, upstream, speaker):
    _, channel = served
    c = await Conversation(channel).__aenter__()
    try:
        c.send("session.update", session={"responder": "openai", "tools": {"functions": [WEATHER]},
                                          "input_audio_format": {"encoding": "pcm16", "sample_rate": RATE},
                                          "tool_filler_ms": 100, "tool_timeout_ms": 30000})
        await c.wait_for("session.updated")
        ask(c, "weather in Paris")
        [call] = (await c.wait_for("response.done", timeout=30))["function_calls"]
        filler = await c.wait_for("response.created", count=2, timeout=10)
        assert filler["filler"]
        pcm = np.concatenate([speaker.say("Actually never mind.", RATE), speaker.silence(1.2, RATE)]).tobytes()
        await c.stream(pcm, RATE, speed=2.0)
        cut = await c.wait_for("response.done", response_id=filler["response_id"], timeout=15)
        assert (cut["status"], cut["status_reason"]) == ("cancelled", "turn_detected") or cut["status"] == "completed"
        turn = await c.wait_for("response.created", count=3, timeout=15)
        assert not turn["filler"]
        await c.wait_for("response.done", response_id=turn["response_id"], timeout=30)
        assert tool_results(upstream.bodies[-1]) == [NO_RESULT], "the call stays in the history, unanswered"
        await asyncio.sleep(0.3)
        assert len(c.of_type("response.created")) == 3, "no filler or apology after the user moved on"
        c.send("conversation.item.create", item={"type": "function_call_output", "call_id": call["call_id"],
                                                 "output": "late"})
        assert (await c.wait_for("conversation.item.added", count=2))["item"]["output"] == "late"
    finally:
        await c.__aexit__(None, None, None)


async def test_a_call_prepared_at_a_pause_is_never_sent_before_the_turn_ends(served, upstream, speaker):
    """A pause mid-question prepares a reply that calls get_weather for the words so far (the
    upstream is asked); the user speaks on, so it is discarded: the client sees one response,
    whose one call (for the whole question) comes after speech_stopped."""
    _, channel = served
    asked = len(upstream.bodies)
    c = await Conversation(channel).__aenter__()
    try:
        c.send("session.update", session={"responder": "openai", "tools": {"functions": [WEATHER]},
                                          "input_audio_format": {"encoding": "pcm16", "sample_rate": RATE},
                                          "turn_detection": {"type": "server_vad", "silence_duration_ms": 1200},
                                          **NO_FILLER})
        pcm = np.concatenate([speaker.silence(0.5, RATE), speaker.say("What is the weather like", RATE),
                              speaker.silence(0.6, RATE), speaker.say("in Paris today?", RATE),
                              speaker.silence(1.8, RATE)]).tobytes()
        await c.stream(pcm, RATE)
        done = await c.wait_for("response.done", timeout=30)
        assert [x["name"] for x in done["function_calls"]] == ["get_weather"]
        (created,) = c.of_type("response.created")
        assert {e["response_id"] for e in c.of_type("response.output_item.added")} == {created["response_id"]}
        order = c.types()
        assert order.index("input_audio_buffer.speech_stopped") < order.index("response.output_item.added")
    finally:
        await c.__aexit__(None, None, None)
    said = [next(m["content"] for m in reversed(b["messages"]) if m["role"] == "user") for b in upstream.bodies[asked:]]
    assert len(said) >= 2 and "paris" not in said[0].lower() and "paris" in said[-1].lower(), said
