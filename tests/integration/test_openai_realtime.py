"""`/v1/realtime` through the official `openai` SDK's `realtime.connect()`: spoken turns with
server VAD at 24 kHz PCM and at G.711 μ-law, a manual turn, a barge-in and its truncation,
text-only and out-of-band responses, a transcription session, item create/retrieve/delete,
the token limit, the idle timeout, every refused field, and hostile input (malformed JSON,
unknown events, bad base64, oversize frames), each an error in the API's shape while another
session goes on."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import av
import numpy as np
import openai
import pytest
import websockets
from aiortc import RTCPeerConnection
from rtmedia.web.audio_encode import G711Encoder
from rtmedia.web.openai.openai_api import OpenAIConfig
from rtmedia.web.openai.realtime_ws import RealtimeLimits

from tests.support import waits
from tests.support.speech import normalise, wer

RATE = 24000
SENTENCE = "please remember to buy milk bread and eggs on your way home"
KEY_WORDS = ("remember", "buy", "milk", "way", "home")


def says(text: str, words: tuple[str, ...] = KEY_WORDS) -> bool:
    """Whether a transcript (or the echo responder's "You said: ...") holds all but one of `words`."""
    found = set(normalise(text).split())
    return sum(w in found for w in words) >= len(words) - 1
SERVER_OPTIONS = {"max_sessions": 6}  # the sockets count against it
# Small frame limits, to test them; a short connect deadline, to wait it out.
WEB_OPTIONS = {"openai": OpenAIConfig(realtime=RealtimeLimits(max_event_bytes=256 * 1024,
                                                              max_frame_bytes=1024 * 1024)),
               "connect_timeout_s": 1.0}


def turn_audio(speaker, text: str = SENTENCE, rate: int = RATE, lead: float = 0.5, tail: float = 1.2) -> bytes:
    return np.concatenate([speaker.silence(lead, rate), speaker.say(text, rate), speaker.silence(tail, rate)]
                          ).astype("<i2").tobytes()


def g711(pcm: bytes, codec: str = "pcm_mulaw", decode: bool = False) -> bytes:
    """PCM16 at 8 kHz to G.711 (or back, with `decode`), by PyAV."""
    if decode:
        context = av.CodecContext.create(codec, "r")
        context.sample_rate, context.layout = 8000, "mono"
        return b"".join(f.to_ndarray().tobytes() for f in context.decode(av.Packet(pcm)))
    return G711Encoder(codec).encode(pcm)


async def stream(conn, pcm: bytes, bytes_per_ms: float, chunk_ms: int = 40, pace: float = 4.0) -> None:
    """Append `pcm` in chunks, `pace` times faster than real time."""
    step = int(chunk_ms * bytes_per_ms) // 2 * 2
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())
        await asyncio.sleep(chunk_ms / 1000 / pace)


async def until(conn, kind: str, events: list | None = None, timeout: float = 30.0, **match) -> object:
    """Receive events (kept in `events`) until one of type `kind` whose fields match."""
    async def run():
        while True:
            event = await conn.recv()
            if events is not None:
                events.append(event)
            if event.type == kind and all(getattr(event, k, None) == v for k, v in match.items()):
                return event

    return await asyncio.wait_for(run(), timeout)


def types(events) -> list[str]:
    return [e.type for e in events]


def audio_of(events) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


@pytest.fixture
async def connect(openai_client):
    """`connect(**kw)`: a Realtime connection of the SDK, its session.created already read."""
    managers = []

    async def open_one(**kw):
        manager = openai_client.realtime.connect(model=kw.pop("model", "gpt-realtime"), **kw)
        conn = await manager.enter()
        managers.append(manager)
        created = await until(conn, "session.created")
        conn.created = created
        return conn

    yield open_one
    for manager in managers:
        await manager.__aexit__(None, None, None)


async def test_spoken_turn_with_server_vad_at_24k(connect, speaker, channel):
    conn = await connect()
    session = conn.created.session
    assert session.audio.input.format.type == "audio/pcm" and session.audio.input.format.rate == RATE
    assert session.audio.input.turn_detection.type == "server_vad"
    assert session.id.startswith("sess_") and conn.created.event_id
    await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                       "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}})
    updated = await until(conn, "session.updated")
    assert updated.session.instructions == "Be brief."
    events: list = []
    await stream(conn, turn_audio(speaker), RATE * 2 / 1000)
    done = await until(conn, "response.done", events, timeout=60)
    kinds = types(events)
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.added", "response.created",
             "response.output_item.added", "response.content_part.added", "response.output_audio.delta",
             "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
             "response.output_item.done", "response.done"]
    assert [k for k in kinds if k in order and kinds.index(k) == kinds.index(k)] and \
        [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
    heard = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    assert wer(SENTENCE, heard.transcript) <= 0.4, heard.transcript
    committed = next(e for e in events if e.type == "input_audio_buffer.committed")
    assert heard.item_id == committed.item_id
    assert done.response.status == "completed" and done.response.output[0].role == "assistant"
    transcript = done.response.output[0].content[0].transcript
    assert says(transcript)  # the echo responder says the user's words
    timings = done.response.model_extra["timings"]  # (rtmedia extension)
    assert timings["preemptive"] in ("committed", "none") and timings["voice_to_voice_ms"] > 0, timings
    pcm = audio_of(events)
    assert len(pcm) / 2 / RATE > 1.0  # seconds of 24 kHz reply audio
    ids = [e.event_id for e in events]
    assert len(set(ids)) == len(ids)


async def test_spoken_turn_in_g711_mulaw(connect, speaker):
    conn = await connect()
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                                     "output": {"format": {"type": "audio/pcmu"}}}})
    updated = await until(conn, "session.updated")
    assert updated.session.audio.output.format.type == "audio/pcmu"
    events: list = []
    await stream(conn, g711(turn_audio(speaker, rate=8000)), 8.0)
    done = await until(conn, "response.done", events, timeout=60)
    assert done.response.status == "completed"
    mulaw = audio_of(events)
    pcm = np.frombuffer(g711(mulaw, decode=True), "<i2")
    assert len(mulaw) / 8000 > 1.0 and len(pcm) == len(mulaw)  # a byte per sample at 8 kHz
    assert np.abs(pcm).max() > 1000  # speech, not silence


async def test_manual_turn_commit_then_response_create(connect, speaker):
    conn = await connect()
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    updated = await until(conn, "session.updated")
    assert updated.session.audio.input.turn_detection is None
    await stream(conn, turn_audio(speaker, tail=0.3), RATE * 2 / 1000, pace=20)
    await conn.input_audio_buffer.commit()
    committed = await until(conn, "input_audio_buffer.committed")
    await conn.response.create()
    events: list = []
    done = await until(conn, "response.done", events, timeout=60)
    assert done.response.status == "completed"
    assert "input_audio_buffer.speech_started" not in types(events)
    assert says(done.response.output[0].content[0].transcript)
    await conn.conversation.item.retrieve(item_id=committed.item_id)
    item = (await until(conn, "conversation.item.retrieved")).item
    assert item.role == "user" and says(item.content[0].transcript)


async def test_answers_follow_the_order_of_the_client_events(connect):
    """Manual turns: a commit is answered before the commit after it, and the first of a burst
    of response.create before the rest (each of which finds that response in progress)."""
    conn = await connect()
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await until(conn, "session.updated")
    silence = base64.b64encode(bytes(2 * RATE // 5)).decode()
    await conn.input_audio_buffer.append(audio=silence)
    await conn.send({"type": "input_audio_buffer.commit", "event_id": "first"})
    await conn.send({"type": "input_audio_buffer.commit", "event_id": "second"})
    events: list = []
    error = await until(conn, "error", events)
    assert error.error.code == "input_audio_buffer_commit_empty" and error.error.event_id == "second"
    assert "input_audio_buffer.committed" in types(events), types(events)
    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a long reply " * 30}]})  # what the echo responder repeats: a while
    await conn.input_audio_buffer.append(audio=silence)
    for n in range(100):
        await conn.send({"type": "response.create", "event_id": f"create{n}"})
    events = []
    while not any(e.type == "error" and e.error.event_id == "create99" for e in events):
        await until(conn, "error", events)
    kinds = types(events)
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created") < kinds.index("error"), kinds
    errors = [e.error for e in events if e.type == "error"]
    assert [e.event_id for e in errors] == [f"create{n}" for n in range(1, 100)]
    assert {e.code for e in errors} == {"response_in_progress"}


LONG = ("the quick brown fox jumps over the lazy dog while the farmer counts his sheep one by one in the green "
        "field behind the old red barn")


async def voice_over_a_reply(conn, speaker, said: str) -> tuple[object, object, list]:
    """A long turn, then `said` at real time while its reply plays: (the reply's first audio
    delta, its response.done, the events from `said` on)."""
    await stream(conn, turn_audio(speaker, LONG), RATE * 2 / 1000, pace=4)
    first = await until(conn, "response.output_audio.delta", timeout=60)
    await asyncio.sleep(0.6)
    events: list = []
    await stream(conn, turn_audio(speaker, said, lead=0.2, tail=0.2), RATE * 2 / 1000, pace=1)
    return first, await until(conn, "response.done", events, timeout=60), events


async def test_barge_in_and_truncate_keep_only_the_heard_part(connect, speaker):
    conn = await connect()
    first, done, events = await voice_over_a_reply(conn, speaker, "stop please")
    assert done.response.id == first.response_id and done.response.status == "cancelled"
    assert done.response.status_details.reason == "turn_detected"
    assert "output_audio_buffer.cleared" in types(events)
    await conn.conversation.item.truncate(item_id=first.item_id, content_index=0, audio_end_ms=400)
    truncated = await until(conn, "conversation.item.truncated")
    assert truncated.item_id == first.item_id and truncated.audio_end_ms == 400
    await conn.conversation.item.retrieve(item_id=first.item_id)
    kept = (await until(conn, "conversation.item.retrieved")).item.content[0].transcript
    assert len(kept.split()) < len(LONG.split()) // 2, kept


async def test_a_backchannel_in_confirmed_mode_never_shows_a_stock_client_speech_started(connect, speaker):
    conn = await connect()
    await conn.session.update(session={"type": "realtime", "audio": {"input": {
        "noise_reduction": {"type": "near_field"},
        "turn_detection": {"type": "server_vad", "interruption": {"mode": "confirmed", "min_speech_ms": 2000}}}}})
    updated = await until(conn, "session.updated")
    assert updated.session.audio.input.noise_reduction.type == "near_field"
    assert updated.session.audio.input.turn_detection.model_extra["interruption"] == {"mode": "confirmed",
                                                                                      "min_speech_ms": 2000}
    first, done, events = await voice_over_a_reply(conn, speaker, "Okay, got it.")
    assert done.response.id == first.response_id and done.response.status == "completed"
    kinds = types(events)
    assert "input_audio_buffer.speech_tentative" in kinds and "input_audio_buffer.backchannel" in kinds, kinds
    assert "input_audio_buffer.speech_started" not in kinds and "output_audio_buffer.cleared" not in kinds


async def test_text_only_response_has_no_audio(connect):
    conn = await connect()
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": "hello there friend"}]})
    await until(conn, "conversation.item.done")
    await conn.response.create(response={"output_modalities": ["text"]})
    events: list = []
    done = await until(conn, "response.done", events)
    kinds = types(events)
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert not [k for k in kinds if "audio" in k]
    assert done.response.output_modalities == ["text"]
    assert done.response.output[0].content[0].text.endswith("hello there friend")


async def test_out_of_band_response_stays_out_of_the_conversation(connect):
    conn = await connect()
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": "classify this"}]})
    await until(conn, "conversation.item.done")
    await conn.response.create(response={"conversation": "none", "metadata": {"topic": "label"},
                                         "output_modalities": ["text"]})
    events: list = []
    done = await until(conn, "response.done", events)
    assert done.response.conversation_id is None and done.response.metadata == {"topic": "label"}
    assert "conversation.item.added" not in types(events)
    await conn.conversation.item.retrieve(item_id=done.response.output[0].id)
    error = await until(conn, "error")
    assert error.error.code == "item_not_found"


async def test_item_create_retrieve_delete(connect):
    conn = await connect()
    await conn.conversation.item.create(item={"id": "item_mine", "type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": "remember the blue door"}]},
                                        event_id="create-1")
    added = await until(conn, "conversation.item.added")
    assert added.item.id == "item_mine" and added.item.content[0].text == "remember the blue door"
    await conn.conversation.item.retrieve(item_id="item_mine")
    assert (await until(conn, "conversation.item.retrieved")).item.content[0].text == "remember the blue door"
    await conn.conversation.item.delete(item_id="item_mine")
    assert (await until(conn, "conversation.item.deleted")).item_id == "item_mine"
    await conn.conversation.item.retrieve(item_id="item_mine", event_id="again")
    error = await until(conn, "error")
    assert error.error.code == "item_not_found" and error.error.event_id == "again"


async def test_audio_item_is_transcribed_into_the_conversation(connect, speaker):
    conn = await connect()
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"transcription": {}}}})
    await until(conn, "session.updated")
    pcm = turn_audio(speaker, tail=0.3)
    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": base64.b64encode(pcm).decode()}]})
    added = await until(conn, "conversation.item.added", timeout=60)
    assert added.item.content[0].type == "input_audio"
    assert says(added.item.content[0].transcript)


async def test_max_output_tokens_ends_a_reply_incomplete(connect):
    conn = await connect()
    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "one two three four five six seven eight"}]})
    await until(conn, "conversation.item.done")
    await conn.response.create(response={"max_output_tokens": 3, "output_modalities": ["text"]})
    done = await until(conn, "response.done")
    assert done.response.status == "incomplete" and done.response.status_details.reason == "max_output_tokens"
    assert len(done.response.output[0].content[0].text.split()) == 3
    assert done.response.max_output_tokens == 3


async def test_idle_timeout_triggers_a_response(connect, speaker):
    conn = await connect()
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 5000}}}})
    await until(conn, "session.updated")
    await stream(conn, turn_audio(speaker, "are you there"), RATE * 2 / 1000)
    await until(conn, "response.done", timeout=60)
    silence = bytes(RATE * 2 // 10)  # the client keeps sending silence, as a phone line does
    events: list = []

    async def keep_sending():
        while True:
            await conn.input_audio_buffer.append(audio=base64.b64encode(silence).decode())
            await asyncio.sleep(0.1)

    sender = asyncio.ensure_future(keep_sending())
    try:
        triggered = await until(conn, "input_audio_buffer.timeout_triggered", events, timeout=30)
        await until(conn, "response.created", events, timeout=30)
    finally:
        sender.cancel()
    assert triggered.item_id and triggered.audio_end_ms >= triggered.audio_start_ms


async def test_a_transcription_language_not_served_is_the_servers_error_and_the_session_goes_on(connect):
    conn = await connect()
    language = "session.audio.input.transcription.language"
    await conn.send({"type": "session.update", "event_id": "french", "session": {"type": "realtime", "audio": {
        "input": {"transcription": {"model": "whisper-1", "language": "fr"}}}}})
    error = (await until(conn, "error")).error
    assert (error.type, error.code, error.param, error.event_id) == \
        ("invalid_request_error", "unsupported_language", language, "french")
    assert "'fr' is not served by this recogniser; it serves en" in error.message
    await conn.session.update(session={"type": "realtime", "audio": {"input": {
        "transcription": {"model": "whisper-1", "language": "en-US"}}}})
    updated = await until(conn, "session.updated")
    assert updated.session.audio.input.transcription.language == "en-US"  # as the client set it
    await conn.send({"type": "session.update", "session": {"type": "realtime", "audio": {
        "input": {"transcription": {"language": 7}}}}})
    error = (await until(conn, "error")).error
    assert (error.code, error.param) == ("invalid_value", language)


async def test_transcription_session(openai_client, speaker):
    async with openai_client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        created = await until(conn, "session.created")
        assert created.session.type == "transcription"
        await conn.session.update(session={"type": "transcription", "audio": {"input": {
            "transcription": {"model": "gpt-4o-transcribe", "language": "en"}}}})
        await until(conn, "session.updated")
        events: list = []
        await stream(conn, turn_audio(speaker), RATE * 2 / 1000)
        completed = await until(conn, "conversation.item.input_audio_transcription.completed", events, timeout=60)
        assert wer(SENTENCE, completed.transcript) <= 0.4
        assert "conversation.item.input_audio_transcription.delta" in types(events)
        await asyncio.sleep(1.0)
        await conn.response.create()
        error = await until(conn, "error")
        assert "transcription session" in error.error.message
        assert not [e for e in events if e.type.startswith("response.")]


REFUSED = [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "session.tools"),  # echo calls none
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "session.tools[0].type"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "session.tool_choice"),
    # (semantic_vad needs an LM, which this module's server does not load)
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "sometimes"}}}},
     "session.audio.input.turn_detection.eagerness"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "threshold": 0.5}}}},
     "session.audio.input.turn_detection.threshold"),
    ({"audio": {"input": {"noise_reduction": {"type": "tunnel"}}}}, "session.audio.input.noise_reduction.type"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "interruption": {"mode": "polite"}}}}},
     "session.audio.input.turn_detection.interruption.mode"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "interruption": {"min_words": 0}}}}},
     "session.audio.input.turn_detection.interruption.min_words"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "preemptive": "yes"}}}},
     "session.audio.input.turn_detection.preemptive"),
    ({"include": ["item.input_text.logprobs"]}, "session.include"),
    ({"audio": {"output": {"format": {"type": "audio/opus"}}}}, "session.audio.output.format.type"),
    ({"audio": {"output": {"voice": {"id": "voice_123"}}}}, "session.audio.output.voice"),
    ({"prompt": {"id": "pmpt_1"}}, "session.prompt"),
    ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
    ({"max_output_tokens": 0}, "session.max_output_tokens"),
    ({"no_such_field": 1}, "session.no_such_field"),
]


@pytest.mark.parametrize("session,param", REFUSED)
async def test_refused_session_fields_name_the_field_and_the_session_goes_on(connect, session, param):
    conn = await connect()
    await conn.session.update(session={"type": "realtime", **session}, event_id="bad-update")
    error = await until(conn, "error")
    assert error.error.param == param and error.error.event_id == "bad-update", error
    assert error.error.type == "invalid_request_error" and error.event_id
    await conn.session.update(session={"type": "realtime", "instructions": "still here"})
    assert (await until(conn, "session.updated")).session.instructions == "still here"


async def test_refused_items_and_response_fields(connect):
    conn = await connect()
    cases = [
        ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}}, "item.content[0].type"),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "nope",
                                                       "output": "{}"}}, "item.call_id"),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "output": "{}"}},
         "item.call_id"),
        ({"type": "conversation.item.create", "item": {"type": "reasoning"}}, "item.type"),
        ({"type": "response.create", "response": {"tools": [{"type": "function", "name": "f"}]}}, "response.tools"),
        ({"type": "response.create", "response": {"input": []}}, "response.input"),
        ({"type": "conversation.item.create", "previous_item_id": "root", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}}, "previous_item_id"),
    ]
    for i, (event, param) in enumerate(cases):
        await conn.send({**event, "event_id": f"e{i}"})
        error = await until(conn, "error")
        assert error.error.param == param and error.error.event_id == f"e{i}", (event, error)


async def test_hostile_frames_get_errors_and_another_session_goes_on(connect, speaker, web_front):
    talker = await connect()
    conn = await connect()
    talk = asyncio.ensure_future(stream(talker, turn_audio(speaker), RATE * 2 / 1000))
    hostile = [
        ("{not json", "invalid_json"),
        (json.dumps({"type": "no.such.event"}), "unknown_event"),
        (json.dumps([1, 2]), "invalid_event"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not base64"}), "invalid_value"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()}),
         "invalid_audio"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (300 * 1024)}), "event_too_large"),
        (json.dumps({"type": "response.cancel", "response_id": 5}), "invalid_value"),
    ]
    for frame, code in hostile:
        await conn.send_raw(frame)
        error = await until(conn, "error")
        assert error.error.code == code, (frame[:60], error)
    await talk
    done = await until(talker, "response.done", timeout=60)
    assert done.response.status == "completed"
    # Over the frame limit, the socket is closed (1009): no frame that size is read into memory.
    await conn.send_raw("x" * (2 * 1024 * 1024))
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        await until(conn, "never", timeout=10)
    assert closed.value.rcvd.code == 1009


async def test_handshake_refusals_are_openai_errors(web_front):
    base = f"http://127.0.0.1:{web_front.port}/v1/realtime"
    async with aiohttp.ClientSession() as http:
        async with http.get(base) as plain:  # not a WebSocket
            assert plain.status == 400 and (await plain.json())["error"]["code"] == "websocket_required"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(base + "?model=no-such-model")
        assert refused.value.status == 404


async def earlier_sessions_closed(server) -> None:
    """Sessions of earlier tests may still be closing (a stream waits for its half-close)."""
    await waits.until(lambda: not server.realtime.sessions, what="earlier sessions closing")


async def test_browser_subprotocols_and_the_transport_gauge(web_front, server):
    await earlier_sessions_closed(server)
    url = f"ws://127.0.0.1:{web_front.port}/v1/realtime?model=gpt-realtime"
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, protocols=("realtime", "openai-insecure-api-key.any-key")) as ws:
            assert ws.protocol == "realtime"
            created = json.loads((await ws.receive()).data)
            assert created["type"] == "session.created"
            sample = server.metrics.registry.get_sample_value
            assert sample("rtmedia_transport_sessions_active", {"transport": "openai-ws"}) == 1


async def test_sdk_errors_on_an_unknown_model(openai_client):
    with pytest.raises(Exception) as refused:
        async with openai_client.realtime.connect(model="no-such-model") as conn:
            await conn.recv()
    assert "404" in str(refused.value) or isinstance(refused.value, openai.OpenAIError)


async def test_sockets_count_against_max_sessions(web_front, server):
    url = f"ws://127.0.0.1:{web_front.port}/v1/realtime?model=gpt-realtime"
    await earlier_sessions_closed(server)
    open_before = len(server.realtime.sessions)
    held = []
    async with aiohttp.ClientSession() as http:
        try:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                for _ in range(7):
                    held.append(await http.ws_connect(url))
        finally:
            for ws in held:
                await ws.close()
    assert refused.value.status == 429 and len(held) == 6 - open_before


async def unconnectable_offer() -> str:
    """A valid offer (audio and the `oai-events` data channel) from a client that went away
    without giving its candidates: whoever answers it waits for a connection that never comes."""
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("audio")
        pc.createDataChannel("oai-events")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = pc.localDescription.sdp
    finally:
        await pc.close()
    return "".join(line for line in sdp.splitlines(keepends=True)
                   if not line.startswith(("a=candidate:", "a=end-of-candidates")))


async def test_webrtc_peers_that_never_connect_give_back_their_slot_and_session(web_front, server):
    """On both doors that take offers (the page's and OpenAI's Realtime calls), a valid offer whose
    peer never completes ICE and DTLS holds its bridge slot and its session only until the
    connect deadline (`connect_timeout_s`, short here)."""
    await earlier_sessions_closed(server)
    base = f"http://127.0.0.1:{web_front.port}"
    sdp = await unconnectable_offer()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/offer", json={"sdp": sdp, "type": "offer"}) as res:
            assert res.status == 200, await res.text()
            ids = [(await res.json())["id"]]
        async with http.post(f"{base}/v1/realtime/calls", data=sdp, headers={"Content-Type": "application/sdp"}) as res:
            assert res.status == 201, await res.text()
            ids.append(res.headers["Location"].rsplit("/", 1)[1].removeprefix("rtc_"))
    peers = [web_front.peers[peer_id] for peer_id in ids]
    sample = server.metrics.registry.get_sample_value

    def sessions() -> list[float | None]:
        return [sample("rtmedia_transport_sessions_active", {"transport": t}) for t in ("webrtc", "openai-webrtc")]

    assert sessions() == [1, 1]
    deadline = web_front.config.connect_timeout_s
    await asyncio.wait_for(asyncio.gather(*(peer.closed.wait() for peer in peers)), deadline + 10)
    assert [peer.close_reason for peer in peers] == [f"not connected within {deadline:g} s"] * 2
    assert not web_front.peers
    await earlier_sessions_closed(server)  # the server ends a session once its stream is cancelled
    assert not server.realtime.sessions and sessions() == [0, 0]
