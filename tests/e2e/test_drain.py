"""SIGTERM drains a real `rtmedia serve`: NOT_SERVING, new sessions refused with
DRAINING; every session finishes what is in flight (a reply being played goes out in full,
a turn the user is still speaking is heard to its end and answered), then
session.closed{server_shutdown}; an idle session closes at once; the process exits 0."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rtmedia.protocol.errors import error_reason

from tests.support.converse import Conversation
from tests.support.serve import FEW_SPEAKERS, running_server
from tests.support.waits import until

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(tmp_path):
    with running_server("--metrics-port", "0", "--grace", "20", "--no-llm", "--responder", "echo",
                        log=tmp_path / "serve.log", asr_decoders=FEW_SPEAKERS) as (target, process):
        yield process, target


async def test_sigterm_drains_sessions(server, speaker):
    process, target = server
    speech = speaker.say("Please tell me what the weather will be like tomorrow morning.").tobytes()
    async with grpc.aio.insecure_channel(target) as channel, Conversation(channel) as c, \
            Conversation(channel) as speaking, Conversation(channel) as idle:
        for conversation in (c, speaking, idle):
            await conversation.wait_for("session.created")
        c.send("conversation.item.create", item={"text": "a reply that is still playing " * 4})
        c.send("response.create")
        created = await c.wait_for("response.created")
        await c.wait_for("response.output_audio.delta")
        # the user is mid-sentence at SIGTERM: the rest of it, then a pause, still arrive
        half = len(speech) // 2 // 640 * 640
        await speaking.stream(speech[:half], 16000)
        await speaking.wait_for("input_audio_buffer.speech_started")
        process.send_signal(signal.SIGTERM)
        rest = asyncio.create_task(speaking.stream(speech[half:] + bytes(32000), 16000))
        health = health_pb2_grpc.HealthStub(channel)

        async def not_serving():
            reply = await health.Check(health_pb2.HealthCheckRequest())
            return reply if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING else None

        reply = await until(not_serving, timeout=5, what="health NOT_SERVING after SIGTERM")
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        async with Conversation(channel) as refused:
            await refused.ended()
            assert refused.error is not None and refused.error.code() == grpc.StatusCode.UNAVAILABLE
            assert error_reason(refused.error) == "DRAINING"
        done = await c.wait_for("response.done", timeout=30)
        closed = await c.wait_for("session.closed", timeout=30)
        assert done["response_id"] == created["response_id"] and done["status"] == "completed"
        assert closed["reason"] == "server_shutdown" and closed["t"] >= done["t"]
        await c.ended()
        assert c.error is None
        # the idle session closed at once; the speaking one was heard out and answered, in full
        assert (await idle.wait_for("session.closed"))["reason"] == "server_shutdown"
        await rest
        stopped = await speaking.wait_for("input_audio_buffer.speech_stopped", timeout=30)
        answered = await speaking.wait_for("response.done", timeout=30)
        closed = await speaking.wait_for("session.closed", timeout=30)
        assert answered["status"] == "completed" and speaking.of_type("response.output_audio.delta")
        assert closed["reason"] == "server_shutdown" and closed["t"] >= answered["t"] >= stopped["t"]
        await speaking.ended()
        assert speaking.error is None
    await until(lambda: process.poll() is not None, timeout=30, what="the drained server's exit")
    assert process.returncode == 0
