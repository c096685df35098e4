"""RealtimeService.Converse in-process (real engines, the echo responder): conversation items, text-only
and out-of-band responses, token limits, idle turns, and the transport gauge."""

from __future__ import annotations

import asyncio

from tests.integration.test_realtime import RATE, SENTENCE, utterance
from tests.support.converse import Conversation
from tests.support.speech import wer
from tests.support.waits import until

# ---- conversation items (docs/protocol.md#conversation-items) ----

async def test_items_are_added_retrieved_and_deleted_and_replies_see_only_what_is_left(channel):
    async with Conversation(channel) as c:
        c.send("conversation.item.create", item={"id": "mine", "text": "first words"})
        first = await c.wait_for("conversation.item.added")
        assert first["previous_item_id"] == "" and first["item"] == {"id": "mine", "role": "user",
                                                                     "text": "first words", "audio": ""}
        c.send("conversation.item.create", item={"text": "second words"})
        second = await c.wait_for("conversation.item.added", count=2)
        made = second["item"]["id"]
        assert second["previous_item_id"] == "mine" and made.startswith("item_") and made != "mine"
        c.send("conversation.item.create", event_id="dup", item={"id": "mine", "text": "again"})
        dup = await c.wait_for("error", event_id="dup")
        assert (dup["code"], dup["param"]) == ("invalid_value", "item.id") and "already in use" in dup["message"]
        c.send("conversation.item.retrieve", item_id="mine")
        assert (await c.wait_for("conversation.item.retrieved"))["item"]["text"] == "first words"
        c.send("conversation.item.delete", item_id=made)
        assert (await c.wait_for("conversation.item.deleted"))["item_id"] == made
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=20)
        assert c.of_type("response.output_text.done")[0]["text"] == "You said: first words", \
            "the deleted item is not in what the responder sees"
        c.send("conversation.item.retrieve", event_id="gone", item_id=made)
        gone = await c.wait_for("error", event_id="gone")
        assert (gone["code"], gone["param"]) == ("item_not_found", "item_id")
        created = c.of_type("response.created")[0]
        c.send("conversation.item.retrieve", item_id=created["item_id"])
        reply = await c.wait_for("conversation.item.retrieved", count=2)
        assert reply["item"]["role"] == "assistant" and reply["item"]["text"] == "You said: first words"
        assert done["status"] == "completed"
        c.send("conversation.item.delete", item_id=created["item_id"])
        await c.wait_for("conversation.item.deleted", count=2)
        c.send("conversation.item.truncate", event_id="cut", item_id=created["item_id"], audio_end_ms=0)
        cut = await c.wait_for("error", event_id="cut")
        assert cut["code"] == "item_not_found", "a deleted reply cannot be truncated"
        # the item of a reply still being generated cannot be deleted: cancel it first
        c.send("conversation.item.create", item={"text": "a long reply " * 30})
        c.send("response.create")
        generating = await c.wait_for("response.created", count=2)
        c.send("conversation.item.delete", event_id="busy", item_id=generating["item_id"])
        busy = await c.wait_for("error", event_id="busy")
        assert (busy["code"], busy["param"]) == ("invalid_state", "item_id") and "cancel it first" in busy["message"]
        c.send("response.cancel")
        assert (await c.wait_for("response.done", count=2, timeout=10))["status"] == "cancelled"


async def test_an_audio_item_is_transcribed_and_joins_the_history(server, channel, speaker, monkeypatch):
    pcm, _, _ = utterance(speaker, SENTENCE, lead=0.2, tail=0.3)
    async with Conversation(channel) as c:
        c.send("conversation.item.create", item={"id": "clip", "audio": pcm})
        c.send("response.create")  # waits for the item's transcript
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed", timeout=20)
        added = await c.wait_for("conversation.item.added")
        assert completed["item_id"] == "clip" and wer(SENTENCE, completed["transcript"]) < 0.4, completed
        assert added["item"] == {"id": "clip", "role": "user", "text": completed["transcript"], "audio": ""}
        assert all(0 <= w["start_ms"] < w["end_ms"] <= len(pcm) / 2 / RATE * 1000 + 50 for w in completed["words"])
        await c.wait_for("response.done", timeout=20)
        assert c.of_type("response.output_text.done")[0]["text"] == f"You said: {completed['transcript']}"
        assert c.types().index("conversation.item.added") < c.types().index("response.output_text.delta")
        assert not c.of_type("input_audio_buffer.committed"), "an audio item is no input buffer turn"
        monkeypatch.setattr(server.realtime.context.limits, "max_item_audio_ms", 500)
        c.send("conversation.item.create", event_id="long", item={"audio": pcm})
        long = await c.wait_for("error", event_id="long")
        assert (long["code"], long["param"]) == ("invalid_value", "item.audio") and "500 ms limit" in long["message"]


async def test_a_failed_transcription_is_its_own_event(server, channel, speaker, monkeypatch):
    engine = server.scheduler.lanes["asr"].engine
    real, fail = engine.step, {"next": True}

    def step(items, urgent=False):
        if fail["next"] and not urgent:
            fail["next"] = False
            raise RuntimeError("injected recogniser failure")
        return real(items, urgent)

    monkeypatch.setattr(engine, "step", step)
    pcm, _, _ = utterance(speaker, "Hello there.", lead=0.2, tail=0.3)
    async with Conversation(channel) as c:
        c.send("conversation.item.create", item={"id": "clip", "audio": pcm})
        failed = await c.wait_for("conversation.item.input_audio_transcription.failed", timeout=20)
        assert failed["item_id"] == "clip" and failed["code"] == "engine_failed"
        assert "injected recogniser failure" in failed["message"]
        await c.wait_for("conversation.item.input_audio_transcription.completed", item_id="clip", timeout=20)
        assert not c.of_type("error"), "no generic error event for it"


# ---- responses: text only, out of band, token limits ----

async def test_a_text_only_response_sends_no_audio(channel):
    async with Conversation(channel) as c:
        c.send("session.update", session={"output_modality": "text"})
        assert (await c.wait_for("session.updated"))["session"]["output_modality"] == "text"
        c.send("conversation.item.create", item={"text": "just words please"})
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed" and done["usage"]["output_audio_ms"] == 0
        assert c.of_type("response.output_text.done")[0]["text"] == "You said: just words please"
        assert "".join(e["delta"] for e in c.of_type("response.output_text.delta")) == "You said: just words please"
        # and per response: an audio session asks for one text-only reply
        c.send("session.update", session={"output_modality": "audio"})
        c.send("response.create", output_modality="text")
        await c.wait_for("response.done", count=2, timeout=20)
        assert not [t for t in c.types() if t.startswith(("response.output_audio", "output_audio_buffer"))]
        c.send("response.create")
        await c.wait_for("response.done", count=3, timeout=20)
        assert c.of_type("response.output_audio.delta") and c.of_type("response.output_audio.done")


async def test_an_out_of_band_response_stays_out_of_the_history(channel):
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "none"}})
        c.send("conversation.item.create", item={"text": "remember this"})
        c.send("input_audio_buffer.append", audio=b"\x00\x00" * (RATE // 2))  # buffered, not for it
        c.send("response.create", conversation="none")
        created = await c.wait_for("response.created")
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        assert c.of_type("response.output_text.done")[0]["text"] == "You said: remember this"
        assert not c.of_type("input_audio_buffer.committed"), "no user turn is committed for it"
        c.send("conversation.item.retrieve", event_id="oob", item_id=created["item_id"])
        assert (await c.wait_for("error", event_id="oob"))["code"] == "item_not_found"
        c.send("response.create")  # an ordinary one commits the buffered audio and joins
        await c.wait_for("input_audio_buffer.committed")
        second = await c.wait_for("response.created", count=2)
        await c.wait_for("response.done", count=2, timeout=20)
        c.send("conversation.item.retrieve", item_id=second["item_id"])
        assert (await c.wait_for("conversation.item.retrieved"))["item"]["role"] == "assistant"


async def test_the_token_limit_makes_a_response_incomplete_and_zero_is_inf(channel):
    async with Conversation(channel) as c:
        c.send("session.update", session={"max_output_tokens": 3})
        c.send("conversation.item.create", item={"text": "one two three four five"})
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=20)
        assert (done["status"], done["status_reason"]) == ("incomplete", "max_output_tokens"), done
        assert c.of_type("response.output_text.done")[0]["text"] == "You said: one"
        assert c.of_type("response.output_audio.done"), "an incomplete response finishes its audio"
        c.send("response.create", max_output_tokens=0)  # "inf" for this response
        done = await c.wait_for("response.done", count=2, timeout=20)
        assert done["status"] == "completed"
        assert c.of_type("response.output_text.done")[1]["text"] == "You said: one two three four five"
        c.send("session.update", session={"max_output_tokens": 0})
        assert (await c.wait_for("session.updated", count=2))["session"]["max_output_tokens"] == 0
        c.send("response.create")
        assert (await c.wait_for("response.done", count=3, timeout=20))["status"] == "completed"


# ---- idle turns (docs/protocol.md#idle-turns) ----

async def test_idle_timeout_ms_prompts_a_quiet_user(channel):
    """idle_timeout_ms 5000 (OpenAI's minimum): 5 s after the reply's playback ended (the client
    acks all of it at once), with only silence coming in, the server commits an empty turn and
    answers; the quiet stretch is stated in input time."""
    silence = b"\x00\x00" * (RATE // 50)  # 20 ms
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"idle_timeout_ms": 5000}})
        updated = await c.wait_for("session.updated")
        assert updated["session"]["turn_detection"]["idle_timeout_ms"] == 5000
        streaming = True

        async def keep_streaming() -> None:
            while streaming:
                c.send("input_audio_buffer.append", audio=silence)
                await asyncio.sleep(0.02)

        streamer = asyncio.create_task(keep_streaming())
        try:
            c.send("conversation.item.create", item={"text": "hello there"})
            c.send("response.create")
            done = await c.wait_for("response.done", timeout=20)
            sent = done["usage"]["output_audio_ms"]
            c.send("playback.ack", response_id=done["response_id"], played_ms=sent)  # all of it played
            acked = (await c.wait_for("playback.acknowledged"))["t"]
            triggered = await c.wait_for("input_audio_buffer.timeout_triggered", timeout=15)
        finally:
            streaming = False
            await streamer
        assert 4.9 <= triggered["t"] - acked <= 6.5, triggered["t"] - acked
        assert 4000 <= triggered["audio_end_ms"] - triggered["audio_start_ms"] <= 5600, triggered
        committed = await c.wait_for("input_audio_buffer.committed")
        assert committed["item_id"] == triggered["item_id"] and committed["audio_ms"] == 0
        created = await c.wait_for("response.created", count=2)
        assert triggered["t"] <= committed["t"] <= created["t"]
        prompted = await c.wait_for("response.done", count=2, timeout=20)
        assert prompted["status"] == "completed" and prompted["response_id"] == created["response_id"]
        assert not c.of_type("session.closed"), "not idle_timeout_s: the session goes on"


# ---- transport ----

async def test_the_transport_gauge_counts_sessions_by_their_metadata(server, channel):
    def active(transport: str) -> float:
        value = server.metrics.registry.get_sample_value("rtmedia_transport_sessions_active", {"transport": transport})
        return value or 0.0

    # sessions of earlier tests may still be closing
    await until(lambda: not server.realtime.sessions, what="earlier sessions closing")
    before = {t: active(t) for t in ("grpc", "openai-ws", "other")}
    async with Conversation(channel, metadata=(("rtmedia-transport", "openai-ws"),)) as ws, \
            Conversation(channel, metadata=(("rtmedia-transport", "telegraph"),)) as odd, Conversation(channel) as plain:
        for c in (ws, odd, plain):
            await c.wait_for("session.created")
        assert {t: active(t) - before[t] for t in before} == {"grpc": 1, "openai-ws": 1, "other": 1}
        transports = sorted(s.transport for s in server.realtime.sessions.values())
        assert transports == ["grpc", "openai-ws", "other"]
    await until(lambda: {t: active(t) for t in before} == before, what="the transport gauges back")
    assert {t: active(t) for t in before} == before
