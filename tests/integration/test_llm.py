"""The LM brain through Converse: the embedded SmolLM2 (`llm`), a local transformers
directory (`transformers`) and an OpenAI-compatible server (`openai`)."""

from __future__ import annotations

import base64
import json

import grpc
from aiohttp import web
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig

from tests.support.converse import Conversation
from tests.support.serve import free_port
from tests.support.speech import normalise, transcribe, wer

SERVER_OPTIONS = {"llm": True, "default_responder": "llm", "lm_slots": 2}
RATE = 24000


def prompt_text(server, n: int = -1) -> str:
    lane = server.scheduler.lanes["llm"]
    return lane.engine.tokenizer.decode(lane.prompts[n])


async def test_spoken_question_gets_an_answer_with_paris(channel, speaker):
    """A spoken question is answered with Paris, in the text and in the reply audio as
    transcribed again. The conversation first holds two typed exchanges, which the model
    imitates ("Paris is the capital of France."): its bare answer to the lowercase
    transcript, "The capital of France is Paris.", is the one phrase PocketSphinx hears
    as "...Francis parents"."""
    import numpy as np

    pcm = np.concatenate([speaker.silence(0.5, RATE), speaker.say("What is the capital of France?", RATE),
                          speaker.silence(1.2, RATE)]).tobytes()
    async with Conversation(channel) as c:
        c.send("session.update", session={"output_sample_rate": 24000})
        for country, city in (("Spain", "Madrid"), ("Italy", "Rome")):
            c.send("conversation.item.create", item={"role": "user", "text": f"What is the capital of {country}?"})
            c.send("conversation.item.create", item={"role": "assistant", "text": f"{city} is the capital of {country}."})
        created = await c.wait_for("session.created")
        assert created["session"]["responder"] == "llm"
        await c.stream(pcm, RATE, speed=2.0)
        done = await c.wait_for("response.done", timeout=60)
        assert done["status"] == "completed", done
        question = c.of_type("conversation.item.input_audio_transcription.completed")[0]["transcript"]
        text = c.of_type("response.output_text.done")[0]["text"]
        assert {"capital", "france"} <= set(normalise(question).split()), question
        assert "Paris" in text, text
        audio = b"".join(base64.b64decode(e["audio"]) for e in c.of_type("response.output_audio.delta"))
    heard = await transcribe(channel, audio, 24000)
    # (tiny.en hears Piper's sampled "Paris" at the very start of a reply as "Carishes" now and
    # then: the reply's words are checked together)
    assert {"capital", "france"} <= set(normalise(heard).split()) and wer(text, heard) < 0.4, (text, heard)


async def test_second_turn_prompt_holds_the_first_exchange(server, channel):
    async with Conversation(channel) as c:
        c.send("session.update", session={"instructions": "You are a terse assistant. Answer briefly.",
                                          "max_output_tokens": 24})
        c.send("conversation.item.create", item={"text": "My name is Ada."})
        c.send("response.create")
        first = await c.wait_for("response.done", timeout=60)
        reply = c.of_type("response.output_text.done")[0]["text"]
        c.send("conversation.item.create", item={"text": "What is my name?"})
        c.send("response.create")
        await c.wait_for("response.done", count=2, timeout=60)
    assert first["status"] in ("completed", "incomplete") and reply  # incomplete: its 24 tokens ran out
    prompt = prompt_text(server)
    assert "terse assistant" in prompt
    assert prompt.index("My name is Ada.") < prompt.index(reply.strip()) < prompt.index("What is my name?")


async def test_prompt_after_barge_in_keeps_only_what_was_heard(server, channel):
    async with Conversation(channel) as c:
        c.send("conversation.item.create", item={"text": "Count slowly from one to forty, in words."})
        c.send("response.create")
        created = await c.wait_for("response.created")
        await c.wait_for("response.output_audio.delta", count=10, timeout=60)  # a few clauses
        # deltas are up to 200 ms (a clause's or window's last one is shorter): ack part of what came
        received_ms = sum(len(base64.b64decode(e["audio"])) // 2 * 1000 // e["sample_rate"]
                          for e in c.of_type("response.output_audio.delta"))
        c.send("playback.ack", response_id=created["response_id"], played_ms=min(1800, received_ms * 9 // 10))
        await c.wait_for("playback.acknowledged")
        c.send("response.cancel")
        cancelled = await c.wait_for("response.done", timeout=10)
        assert cancelled["status"] == "cancelled"
        session = next(s for s in server.realtime.sessions.values() if created["response_id"] in s.replies.responses)
        heard = session.replies.responses[created["response_id"]].heard_text()
        c.send("conversation.item.create", item={"text": "Go on."})
        c.send("response.create")
        await c.wait_for("response.done", count=2, timeout=60)
    prompt = prompt_text(server)
    said = "".join(e["delta"] for e in c.of_type("response.output_text.delta")
                   if e["response_id"] == created["response_id"])
    assert heard and heard in prompt, (heard, prompt)
    assert said.strip() not in prompt or said.strip() == heard, "the unheard rest must not be in the prompt"


async def test_waiting_for_a_slot_is_announced_and_served(channel):
    """lm_slots=2 here: a third simultaneous response waits, says so, then completes."""

    async def ask(n: int) -> Conversation:
        c = Conversation(channel)
        await c.__aenter__()
        c.send("session.update", session={"max_output_tokens": 24})
        c.send("conversation.item.create", item={"text": f"Say a long sentence about the number {n}."})
        c.send("response.create")
        return c

    conversations = [await ask(n) for n in range(3)]
    try:
        done = [await c.wait_for("response.done", timeout=90) for c in conversations]
        assert all(d["status"] in ("completed", "incomplete") for d in done), done  # 24 tokens may run out
        waiting = [e for c in conversations for e in c.of_type("response.waiting")]
        assert waiting and waiting[0]["reason"] == "lm_slot"
    finally:
        for c in conversations:
            await c.__aexit__(None, None, None)


async def test_transformers_directory_and_openai_server(tmp_path):
    """`transformers` on a tiny local model directory and `openai` against a streaming
    chat-completions server started here, both through Converse."""
    from rtmedia.engines.lm.models import tiny_llama_dir

    seen: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ["Hello ", "from ", "the ", "remote ", "model."]:
            chunk = {"choices": [{"delta": {"content": word}, "index": 0}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    model_dir = tiny_llama_dir(tmp_path / "tiny")
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1, llm=False, default_responder="echo",
                                        transformers_model=str(model_dir), openai_url=f"http://127.0.0.1:{port}/v1",
                                        openai_model="remote-test"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            async with Conversation(channel) as c:
                c.send("session.update", session={"responder": "openai", "instructions": "Be nice."})
                c.send("conversation.item.create", item={"text": "Hi there"})
                c.send("response.create")
                done = await c.wait_for("response.done", timeout=30)
                assert done["status"] == "completed"
                assert c.of_type("response.output_text.done")[0]["text"] == "Hello from the remote model."
                assert c.of_type("response.output_audio.delta")
            assert seen[0]["model"] == "remote-test" and seen[0]["stream"] is True
            assert seen[0]["messages"][0] == {"role": "system", "content": "Be nice."}
            assert seen[0]["messages"][-1] == {"role": "user", "content": "Hi there"}
            async with Conversation(channel) as c:
                c.send("session.update", session={"responder": "transformers", "max_output_tokens": 8})
                c.send("conversation.item.create", item={"text": "Hello tiny model"})
                c.send("response.create")
                done = await c.wait_for("response.done", timeout=30)
                assert done["status"] in ("completed", "incomplete"), done  # random weights: 8 tokens or an end
            lane = server.scheduler.lanes["transformers"]
            assert "Hello tiny model" in lane.engine.tokenizer.decode(lane.prompts[-1])
    finally:
        await server.stop(0)
        await runner.cleanup()
