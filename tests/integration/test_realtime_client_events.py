"""RealtimeService.Converse's client events in-process (real engines, the echo responder): bad input is an
error event naming the field and the session goes on; unknown events, keys, backpressure, and answers
in the order of the events they answer."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from rtmedia.v1 import realtime_pb2

from tests.integration.test_realtime import RATE, SENTENCE, utterance
from tests.support.converse import Conversation
from tests.support.speech import wer

BAD = [
    ("session.update", {"session": {"noise_reduction": {"type": "tunnel"}}}, "invalid_value",
     "noise_reduction.type", "'tunnel' is not one of"),
    ("session.update", {"session": {"turn_detection": {"threshold": 1.2}}}, "invalid_value",
     "turn_detection.threshold", "outside 0.05..0.95"),
    ("session.update", {"session": {"input_audio_format": {"sample_rate": 44100}}}, "invalid_value",
     "input_audio_format.sample_rate", "44100 is not supported"),
    ("session.update", {"session": {"voice": "nobody"}}, "invalid_value", "voice", "voice 'nobody' is not known"),
    ("session.update", {"session": {"responder": "oracle"}}, "invalid_value", "responder",
     "responder 'oracle' is not available"),
    ("session.update", {"session": {"output_sample_rate": 7}}, "invalid_value", "output_sample_rate",
     "sample_rate=7 is not supported by voice en_US-joe-medium"),
    ("input_audio_buffer.append", {"audio": b"\x00" * 1001}, "invalid_audio", "audio", "1001 bytes"),
    ("input_audio_buffer.commit", {}, "invalid_state", "", "server_vad commits turns itself"),
    ("playback.ack", {"response_id": "resp_nope", "played_ms": 5}, "response_not_found", "response_id", "resp_nope"),
    ("conversation.item.truncate", {"item_id": "item_nope", "audio_end_ms": 5}, "item_not_found", "item_id",
     "item_nope"),
    ("camera.frame", {"image": b"\xff\xd8\xff" + b"\x00" * (2 * 1024 * 1024), "mime_type": "image/jpeg"},
     "invalid_value", "image", "over the 2097152-byte limit"),
    ("camera.frame", {"image": b"GIF89a....", "mime_type": "image/gif"}, "invalid_value", "image",
     "neither JPEG nor PNG"),
    ("conversation.item.create", {"item": {"role": "system", "text": "x"}}, "invalid_value", "item.role", "system"),
    ("response.cancel", {}, "response_not_found", "response_id", "no response"),
    ("conversation.item.create", {"item": {"text": "x", "audio": b"\x00\x00"}}, "invalid_value", "item.audio",
     "text or audio, not both"),
    ("conversation.item.create", {"item": {"audio": b"\x00" * 1001}}, "invalid_audio", "item.audio", "1001 bytes"),
    ("conversation.item.create", {"item": {"role": "assistant", "audio": b"\x00\x00"}}, "invalid_value",
     "item.role", "an audio item is a user turn"),
    ("conversation.item.create", {"item": {"id": "x" * 300, "text": "hi"}}, "invalid_value", "item.id",
     "item.id is 300 bytes"),
    ("conversation.item.delete", {"item_id": "item_nope"}, "item_not_found", "item_id", "item_nope"),
    ("conversation.item.retrieve", {"item_id": "item_nope"}, "item_not_found", "item_id", "item_nope"),
    ("session.update", {"session": {"turn_detection": {"idle_timeout_ms": 100}}}, "invalid_value",
     "turn_detection.idle_timeout_ms", "outside 5000..30000"),
    ("session.update", {"session": {"turn_detection": {"type": "manual", "idle_timeout_ms": 6000}}},
     "invalid_value", "turn_detection.idle_timeout_ms", "for server_vad turn detection only"),
    ("session.update", {"session": {"output_modality": "smell"}}, "invalid_value", "output_modality",
     "must be \"audio\" or \"text\""),
    ("session.update", {"session": {"max_output_tokens": 5000}}, "invalid_value", "max_output_tokens",
     "outside 1..4096"),
    ("response.create", {"output_modality": "smell"}, "invalid_value", "output_modality", "must be"),
    ("response.create", {"conversation": "elsewhere"}, "invalid_value", "conversation", "must be \"auto\" or"),
    ("response.create", {"max_output_tokens": 5000}, "invalid_value", "max_output_tokens", "outside 1..4096"),
    ("session.update", {"session": {"turn_detection": {"interruption": {"mode": "polite"}}}}, "invalid_value",
     "turn_detection.interruption.mode", "'polite' is not one of immediate, confirmed"),
    ("session.update", {"session": {"turn_detection": {"interruption": {"min_speech_ms": -5}}}}, "invalid_value",
     "turn_detection.interruption.min_speech_ms", "outside 200..10000"),
    ("session.update", {"session": {"turn_detection": {"interruption": {"backchannels": ["ok", ""]}}}},
     "invalid_value", "turn_detection.interruption.backchannels[1]", "must be 1..64 characters"),
    ("session.update", {"session": {"input_audio_transcription": {"language": "fr-FR"}}}, "unsupported_language",
     "input_audio_transcription.language", "'fr-FR' is not served by this recogniser; it serves en (an English-only"),
]


@pytest.mark.parametrize("name,fields,code,param,message", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
async def test_bad_input_is_an_error_event_and_the_session_goes_on(channel, name, fields, code, param, message):
    async with Conversation(channel) as c:
        c.send(name, event_id="evt_bad", **fields)
        error = await c.wait_for("error")
        assert (error["code"], error["param"], error["event_id"]) == (code, param, "evt_bad"), error
        assert message in error["message"], error["message"]
        c.send("conversation.item.create", item={"text": "still here"})
        c.send("response.create")
        assert (await c.wait_for("response.done", timeout=20))["status"] == "completed"


async def test_an_english_transcription_language_is_echoed_as_its_code_and_turns_are_heard(channel, speaker):
    pcm, *_ = utterance(speaker, SENTENCE)
    async with Conversation(channel) as c:
        created = await c.wait_for("session.created")
        assert created["session"]["input_audio_transcription"] == {"enabled": True, "language": ""}
        for asked in ("english", "en-US"):
            c.send("session.update", session={"input_audio_transcription": {"language": asked}})
            updated = await c.wait_for("session.updated", count=1 if asked == "english" else 2)
            assert updated["session"]["input_audio_transcription"]["language"] == "en"
        await c.stream(pcm, RATE, speed=2.0)
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed", timeout=20)
        assert wer(SENTENCE, completed["transcript"]) < 0.4, completed["transcript"]


async def test_unknown_event_and_mode_errors(channel, speaker):
    async with Conversation(channel) as c:
        c._requests.put_nowait(realtime_pb2.ConverseRequest(event_id="evt_empty"))
        error = await c.wait_for("error")
        assert error["code"] == "unknown_event" and error["event_id"] == "evt_empty"
        c.send("session.update", session={"turn_detection": {"type": "manual"}})
        await c.wait_for("session.updated")
        c.send("input_audio_buffer.commit")
        assert (await c.wait_for("error", count=2))["code"] == "input_audio_buffer_commit_empty"
        pcm, _, _ = utterance(speaker, "Hello there.", tail=0.2)
        await c.stream(pcm[: RATE], RATE, speed=8.0)
        c.send("session.update", session={"input_audio_format": {"sample_rate": 16000}})
        error = await c.wait_for("error", count=3)
        assert error["code"] == "invalid_state" and "mid-turn" in error["message"]
        c.send("conversation.item.create", item={"text": "a long reply " * 30})
        c.send("response.create")
        await c.wait_for("response.created")
        c.send("response.create")
        assert (await c.wait_for("error", count=4))["code"] == "response_in_progress"
        c.send("input_audio_buffer.clear")
        cleared = await c.wait_for("input_audio_buffer.cleared")
        assert cleared["reason"] == "client" and cleared["discarded_ms"] > 0


async def test_a_keypad_key_is_told_back_and_a_bad_one_refused(channel):
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        before = int(time.time())
        c.send("input_audio_buffer.dtmf", event="#")
        received = await c.wait_for("input_audio_buffer.dtmf_event_received")
        assert received["event"] == "#" and before <= int(received["received_at"]) <= int(time.time())
        for bad in ("55", "x", ""):
            c.send("input_audio_buffer.dtmf", event_id=f"evt_{bad}", event=bad)
            error = await c.wait_for("error", event_id=f"evt_{bad}")
            assert error["code"] == "invalid_value" and error["param"] == "event", error
        c.send("input_audio_buffer.dtmf", event="7")
        assert (await c.wait_for("input_audio_buffer.dtmf_event_received", count=2))["event"] == "7"


async def test_backpressure_says_what_was_discarded(channel):
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        c.send("input_audio_buffer.append", audio=b"\x00\x00" * (RATE * 3))  # 3 s: more than the 2 s inbox
        error = await c.wait_for("error")
        cleared = await c.wait_for("input_audio_buffer.cleared")
        assert error["code"] == "input_backpressure" and "discarded" in error["message"]
        assert cleared["reason"] == "input_backpressure" and cleared["discarded_ms"] == 3000


async def test_a_manual_append_over_the_inbox_is_taken_whole(channel, speaker):
    """Without VAD nothing has to keep pace with the input: one append of 3 s (over the 2 s
    inbox) is queued whole, committed as 3000 ms, transcribed and answered; a clear says what
    it dropped, once."""
    speech = speaker.say("Please remember to buy milk.", 16000)
    pcm = np.concatenate([speaker.silence(0.3), speech, speaker.silence(3 - 0.3 - len(speech) / 16000)]).tobytes()
    assert len(pcm) == 3 * 16000 * 2
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "manual"},
                                          "input_audio_format": {"sample_rate": 16000}})
        await c.wait_for("session.updated")
        c.send("input_audio_buffer.append", event_id="long", audio=pcm)
        c.send("input_audio_buffer.commit")
        committed = await c.wait_for("input_audio_buffer.committed")
        assert committed["audio_ms"] == 3000
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed")
        assert completed["item_id"] == committed["item_id"] and wer("remember to buy milk", completed["transcript"]) < 0.5
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        assert c.of_type("response.output_text.done")[0]["text"] == f"You said: {completed['transcript']}"
        c.send("input_audio_buffer.append", audio=pcm[:16000 * 2])
        c.send("input_audio_buffer.clear")
        cleared = await c.wait_for("input_audio_buffer.cleared")
        assert cleared["discarded_ms"] == 1000, cleared
        assert not c.of_type("error"), c.of_type("error")


async def test_answers_follow_the_order_of_the_client_events(channel):
    """The first of a burst of response.create is answered before the rest (each of which finds
    that response in progress); test_hostile checks the same of two commits."""
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "none"}})
        await c.wait_for("session.updated")
        c.send("conversation.item.create", item={"text": "a long reply " * 30})  # what the echo repeats: a while
        c.send("input_audio_buffer.append", audio=b"\0\0" * 4800)
        for n in range(100):
            c.send("response.create", event_id=f"create{n}")

        def answers() -> list[str]:  # the create each answer is about, in the order they came
            return [e.get("event_id") or e.get("request_event_id") for e in c.events
                    if e["type"] in ("error", "response.created")]

        async with c._arrived:
            await asyncio.wait_for(c._arrived.wait_for(lambda: "create99" in answers()), 15)
        assert answers() == [f"create{n}" for n in range(100)], answers()
        assert {e["code"] for e in c.of_type("error")} == {"response_in_progress"}
        assert c.types().index("input_audio_buffer.committed") < c.types().index("response.created")
