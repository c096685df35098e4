"""semantic_vad end to end (docs/protocol.md#semantic-vad): real Piper speech, the real VAD,
PocketSphinx's early finals and the embedded SmolLM2 scoring them on the LM lane.

A finished sentence's turn ends before server_vad's 500 ms of silence; a sentence paused for
700 ms where it is plainly unfinished stays one turn; the longest wait ends a turn whatever its
score; bad values are error events naming the field; the turn-end reasons reach the metrics;
the OpenAI-compatible /v1/realtime serves `semantic_vad` as the API spells it."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from rtmedia.v1 import realtime_pb2

from tests.support.converse import Conversation

SERVER_OPTIONS = {"llm": True, "default_responder": "echo", "lm_slots": 4}
RATE = 16000


def semantic(**fields) -> dict:
    return {"input_audio_format": {"sample_rate": RATE}, "turn_detection": {"type": "semantic_vad", **fields}}


def audio(speaker, *parts: str | float) -> bytes:
    """Speech for each string, silence for each number of seconds."""
    return np.concatenate([speaker.say(p, RATE) if isinstance(p, str) else speaker.silence(p, RATE)
                           for p in parts]).astype("<i2").tobytes()


async def speak(conversation: Conversation, pcm: bytes) -> float:
    """Send `pcm` at real time; the stream time it started."""
    return await conversation.stream(pcm, RATE)


def waited(event: dict, started: float) -> float:
    """Seconds from the end of speech (audio_end_ms) to the speech_stopped event."""
    return event["t"] - started - event["audio_end_ms"] / 1000


def turn_ends(server, reason: str) -> float:
    return server.metrics.turn_ends.labels(reason)._value.get()


@pytest.mark.serial
async def test_a_finished_sentence_ends_its_turn_before_500_ms_of_silence(server, channel, speaker):
    before = turn_ends(server, "semantic")
    async with Conversation(channel) as c:
        c.send("session.update", session=semantic())
        updated = await c.wait_for("session.updated")
        assert updated["session"]["turn_detection"]["type"] == "semantic_vad"
        assert updated["session"]["turn_detection"]["eagerness"] == "auto"
        started = await speak(c, audio(speaker, 0.3, "What is the weather like today?", 1.0))
        stopped = await c.wait_for("input_audio_buffer.speech_stopped")
        assert stopped["reason"] == "semantic" and stopped["score"] > -2.2, stopped
        assert waited(stopped, started) < 0.5
        heard = await c.wait_for("conversation.item.input_audio_transcription.completed")
        assert "weather" in heard["transcript"]
        await c.wait_for("response.done")  # the turn is answered as a server_vad turn is
    assert turn_ends(server, "semantic") == before + 1


async def test_a_sentence_paused_where_it_is_unfinished_is_one_turn(channel, speaker):
    async with Conversation(channel) as c:
        c.send("session.update", session=semantic())
        await c.wait_for("session.updated")
        await speak(c, audio(speaker, 0.3, "I would like to book a table for", 0.7, "four people tonight.", 1.0))
        heard = await c.wait_for("conversation.item.input_audio_transcription.completed")
        assert len(c.of_type("input_audio_buffer.speech_started")) == 1
        assert len(c.of_type("input_audio_buffer.speech_stopped")) == 1
        assert "table" in heard["transcript"] and "tonight" in heard["transcript"], heard


async def test_the_longest_wait_ends_a_turn_whatever_its_score(channel, speaker):
    """Low eagerness with a 1 s longest wait: an unfinished sentence's turn ends at 1 s of
    silence, reason max_wait."""
    async with Conversation(channel) as c:
        c.send("session.update", session=semantic(eagerness="low", max_wait_ms=1000))
        updated = await c.wait_for("session.updated")
        assert updated["session"]["turn_detection"]["max_wait_ms"] == 1000
        started = await speak(c, audio(speaker, 0.3, "Can you tell me how long the", 1.6))
        stopped = await c.wait_for("input_audio_buffer.speech_stopped")
        assert stopped["reason"] == "max_wait" and "score" not in stopped
        assert 1.0 <= waited(stopped, started) < 1.4


async def test_bad_values_are_errors_naming_the_field_and_the_session_goes_on(channel):
    async with Conversation(channel) as c:
        for turn, param in (({"eagerness": realtime_pb2.Eagerness.Value("EAGERNESS_HIGH") + 7},
                             "turn_detection.eagerness"),
                            ({"candidate_ms": -100}, "turn_detection.candidate_ms"),
                            ({"max_wait_ms": -1}, "turn_detection.max_wait_ms")):
            c.send("session.update", event_id=param, session={"turn_detection": {"type": "semantic_vad", **turn}})
            error = await c.wait_for("error", event_id=param)
            assert error["param"] == param and error["code"] == "invalid_value", error
        c.send("session.update", session=semantic(eagerness="high"))
        updated = await c.wait_for("session.updated")
        assert updated["session"]["turn_detection"]["max_wait_ms"] == 2000


async def test_semantic_vad_over_the_realtime_api(openai_client, speaker):
    async with openai_client.realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}})
        while (event := await conn.recv()).type != "session.updated":
            pass
        assert event.session.audio.input.turn_detection.type == "semantic_vad"
        assert event.session.audio.input.turn_detection.eagerness == "high"
        pcm = np.concatenate([speaker.silence(0.3, 24000), speaker.say("Please set a timer for ten minutes.", 24000),
                              speaker.silence(1.0, 24000)]).astype("<i2").tobytes()
        for at in range(0, len(pcm), 1920):  # 40 ms chunks at twice real time
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[at:at + 1920]).decode())
            await asyncio.sleep(0.02)
        while (event := await conn.recv()).type != "input_audio_buffer.speech_stopped":
            pass
        assert event.model_extra["reason"] == "semantic" and event.model_extra["score"] > -2.6
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}})
        while (event := await conn.recv()).type != "error":
            pass
        assert event.error.param == "session.audio.input.turn_detection.eagerness"
