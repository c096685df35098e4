"""Fault injection in the engines' lanes, on the in-process server with its real engines.

A real engine's step is replaced (monkeypatched) for a moment to raise, to hang past a short
step deadline, or to run out of memory: only that step's calls fail, each with a clear status
or event naming the lane, the next request succeeds, and health goes NOT_SERVING for a lane
that stays stalled, for the services that need it, and back to SERVING once it recovers.
(PocketSphinx's worker processes: test_pocketsphinx_faults.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rtmedia.engines.asr.pocketsphinx import AsrEngine
from rtmedia.protocol.errors import error_reason
from rtmedia.v1 import speech_pb2, speech_pb2_grpc

from tests.support.converse import Conversation
from tests.support.speech import normalise
from tests.support.waits import until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SPEECH, REALTIME, VIDEO = "rtmedia.v1.SpeechService", "rtmedia.v1.RealtimeService", "rtmedia.v1.VideoService"
RIVA_ASR = "nvidia.riva.asr.RivaSpeechRecognition"
SENTENCE = "the quick brown fox jumps over the lazy dog"


# The module's server (tests/reliability/conftest.py): the synthetic LM, two slots, and lanes
# that turn unhealthy quickly.
SERVER_OPTIONS = {"max_sessions": 16, "llm": True, "synthetic_lm": "tiny", "lm_slots": 2, "lm_context": 256,
                  "lane_unhealthy_after_s": 0.5}


async def synthesize(channel, text: str) -> bytes:
    stub = speech_pb2_grpc.SpeechServiceStub(channel)
    return b"".join([r.audio async for r in stub.Synthesize(speech_pb2.SynthesizeRequest(text=text))])


async def health(channel) -> dict[str, int]:
    stub = health_pb2_grpc.HealthStub(channel)
    return {name: (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
            for name in ("", SPEECH, REALTIME, VIDEO, RIVA_ASR)}


async def health_becomes(channel, expected: dict[str, int], timeout: float = 10.0) -> None:
    now: dict[str, int] = {}

    async def reached() -> bool:
        now.update(await health(channel))
        return now == expected

    await until(reached, timeout, f"health {expected}", interval=0.1, seen=lambda: now)


def all_serving() -> dict[str, int]:
    return dict.fromkeys(("", SPEECH, REALTIME, VIDEO, RIVA_ASR), SERVING)


def gauge(server, name: str, **labels: str) -> float | None:
    return server.metrics.registry.get_sample_value(name, labels)


def step_that(engine, fails_on: str, effect):
    """The engine's real step, except for a batch holding an item whose text has `fails_on`."""
    real = engine.step

    def step(items, *args, **kwargs):
        if any(fails_on in getattr(item, "text", "") for item in items):
            return effect(items)
        return real(items, *args, **kwargs)
    return step


async def test_a_tts_step_that_raises_fails_that_call_only(server, channel, monkeypatch):
    engine = server.scheduler.lanes["tts"].engine

    def boom(items):
        raise RuntimeError("injected synthesis failure")

    monkeypatch.setattr(engine, "step", step_that(engine, "poison", boom))
    bad, good = await asyncio.gather(synthesize(channel, "A poison sentence."), synthesize(channel, "Hello there."),
                                     return_exceptions=True)
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INTERNAL
    assert error_reason(bad) == "ENGINE_FAILED"
    assert "the tts lane's step failed: RuntimeError: injected synthesis failure" in bad.details()
    assert "Traceback" not in bad.details()
    assert isinstance(good, bytes) and len(good) > 1000, "the other call is untouched"
    assert len(await synthesize(channel, "A plain sentence, again.")) > 1000, "the next request succeeds"
    assert await server.scheduler.check_health() == {}


async def test_out_of_memory_in_a_step_is_resource_exhausted_and_the_lane_stays_healthy(server, channel, monkeypatch):
    engine = server.scheduler.lanes["tts"].engine

    def oom(items):
        raise MemoryError()

    monkeypatch.setattr(engine, "step", step_that(engine, "huge", oom))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await synthesize(channel, "A huge sentence.")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(err.value) == "OUT_OF_MEMORY"
    assert "tts lane" in err.value.details() and "out of memory" in err.value.details()
    assert len(await synthesize(channel, "A small sentence.")) > 1000, "the next request succeeds"
    assert await server.scheduler.check_health() == {} and await health(channel) == all_serving()


async def test_a_hung_tts_step_fails_at_its_deadline_stalls_then_recovers_with_health(server, channel, monkeypatch):
    """Both TTS runners hang past a short deadline: their calls fail at the deadline, a new call
    is refused at once (UNAVAILABLE), health goes NOT_SERVING for the server and the services
    that synthesise (not VideoService) once the stall outlasts lane_unhealthy_after_s, and every
    one of those is back when the steps return; the next call succeeds."""
    lane = server.scheduler.lanes["tts"]
    engine = lane.engine
    release = threading.Event()
    monkeypatch.setattr(lane, "policy", dataclasses.replace(lane.policy, step_deadline_s=0.3))

    def hang(items):
        release.wait(20)
        return [b""] * len(items)

    monkeypatch.setattr(engine, "step", step_that(engine, "hang", hang))
    misses = gauge(server, "rtmedia_lane_deadline_misses_total", lane="tts") or 0
    try:
        started = time.monotonic()
        hung = await asyncio.gather(*(synthesize(channel, f"Please hang here {n}.") for n in range(2)),
                                    return_exceptions=True)
        assert time.monotonic() - started < 3
        for err in hung:
            assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INTERNAL, err
            assert "the tts lane's step ran past its 0.3 s deadline" in err.details()
        refused = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await synthesize(channel, "Hello there.")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and error_reason(err.value) == "ENGINE_UNAVAILABLE"
        assert "the tts lane is stalled" in err.value.details() and time.monotonic() - refused < 1
        assert gauge(server, "rtmedia_lane_deadline_misses_total", lane="tts") == misses + 2
        await health_becomes(channel, {"": NOT_SERVING, SPEECH: NOT_SERVING, REALTIME: NOT_SERVING,
                                       VIDEO: SERVING, RIVA_ASR: SERVING})
        assert gauge(server, "rtmedia_lane_healthy", lane="tts") == 0
    finally:
        release.set()
    await health_becomes(channel, all_serving())
    assert gauge(server, "rtmedia_lane_healthy", lane="tts") == 1
    monkeypatch.undo()  # the real step and deadline again: a busy machine's real step may take a while
    assert len(await synthesize(channel, "Hello again.")) > 1000


async def reply(c: Conversation, n: int) -> dict:
    c.send("conversation.item.create", item={"text": f"Say something, number {n}."})
    c.send("response.create")
    return await c.wait_for("response.done", count=n, timeout=30)


async def test_an_lm_decode_step_that_fails_or_hangs_fails_that_reply_and_the_session_goes_on(server, channel,
                                                                                             monkeypatch):
    lane = server.scheduler.lanes["llm"]
    real, release = lane.engine.decode, threading.Event()
    effects: list = []

    def decode(tokens):
        if effects:
            effects.pop(0)()
        return real(tokens)

    def hang():
        release.wait(20)

    def oom():
        raise MemoryError()

    monkeypatch.setattr(lane.engine, "decode", decode)
    async with Conversation(channel) as c:
        c.send("session.update", session={"responder": "llm", "max_output_tokens": 8})
        await c.wait_for("session.updated")
        effects.append(oom)
        done = await reply(c, 1)
        assert done["status"] == "failed" and "the llm lane's decode step failed: MemoryError" in done["status_reason"]
        # The next reply of the same session works (to its end, or to the 8-token limit).
        assert (await reply(c, 2))["status"] in ("completed", "incomplete")
        # a short deadline for the hang alone (a healthy prefill under load may take longer)
        monkeypatch.setattr(lane, "step_deadline_s", 1.0)
        effects.append(hang)
        try:
            done = await reply(c, 3)
            assert done["status"] == "failed" and "ran past its 1 s deadline" in done["status_reason"]
            done = await reply(c, 4)  # refused at once while the step still hangs
            assert done["status"] == "failed" and "the llm lane is stalled" in done["status_reason"]
        finally:
            release.set()
        await until(lambda: not lane.health.hung, what="the lm lane's recovery")
        monkeypatch.undo()
        assert (await reply(c, 5))["status"] in ("completed", "incomplete")
    assert await server.scheduler.check_health() == {}


async def test_an_asr_step_that_fails_is_an_error_event_and_the_next_turn_is_transcribed(server, channel, speaker,
                                                                                        monkeypatch):
    engine: AsrEngine = server.scheduler.lanes["asr"].engine
    real, fail = engine.step, {"next": False}

    def step(items, urgent=False):
        if fail["next"] and not urgent:
            fail["next"] = False
            raise RuntimeError("injected recogniser failure")
        return real(items, urgent)

    monkeypatch.setattr(engine, "step", step)
    rate = 16000
    turn = np.concatenate([speaker.say(SENTENCE, rate), speaker.silence(0.3, rate)]).tobytes()
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "manual"},
                                          "input_audio_format": {"sample_rate": rate}})
        await c.wait_for("session.updated")
        fail["next"] = True
        await c.stream(turn, rate, speed=4)
        c.send("input_audio_buffer.commit")
        error = await c.wait_for("conversation.item.input_audio_transcription.failed", code="engine_failed")
        assert "the asr lane's step failed: RuntimeError: injected recogniser failure" in error["message"]
        await c.wait_for("conversation.item.input_audio_transcription.completed")
        await c.stream(turn, rate, speed=4)
        c.send("input_audio_buffer.commit")
        done = await c.wait_for("conversation.item.input_audio_transcription.completed", count=2)
        assert "quick brown fox" in normalise(done["transcript"]), done


