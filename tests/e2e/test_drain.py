"""SIGTERM drains a real `rtmedia serve`: NOT_SERVING, new sessions refused with
DRAINING, the response in flight completes, then session.closed{server_shutdown}."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rtmedia.protocol.errors import error_reason

from tests.support.converse import Conversation
from tests.support.serve import running_server

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(tmp_path):
    with running_server("--metrics-port", "0", "--grace", "20", "--responder", "echo",
                        log=tmp_path / "serve.log") as (target, process):
        yield process, target


async def test_sigterm_drains_sessions(server):
    process, target = server
    async with grpc.aio.insecure_channel(target) as channel, Conversation(channel) as c:
        c.send("conversation.item.create", item={"text": "a reply that is still playing " * 4})
        c.send("response.create")
        created = await c.wait_for("response.created")
        await c.wait_for("response.output_audio.delta")
        process.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(50):
            reply = await health.Check(health_pb2.HealthCheckRequest())
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
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
    for _ in range(300):
        if process.poll() is not None:
            break
        await asyncio.sleep(0.1)
    assert process.returncode == 0
