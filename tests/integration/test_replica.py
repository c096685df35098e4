"""What a replica behind a proxy or an autoscaler relies on (deploy/README.md): capacity as a
metric and a refusal, the replica's name on every session, /readyz and /livez on the metrics
port, and the drain delay that keeps admitting while readiness is already off."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rtmedia.protocol.errors import error_reason
from rtmedia.server.cli import build_parser, config_from_args
from rtmedia.server.config import ServerConfig
from rtmedia.server.observe.metrics_http import start_metrics_http

from tests.support.converse import Conversation
from tests.support.serve import RTMEDIA
from tests.support.waits import until

# the capacity checks count sessions that earlier tests closed: under the parallel part's load
# their close can trail the next test's open
pytestmark = pytest.mark.serial
SERVER_OPTIONS = {"capacity_sessions": 2, "max_sessions": 4, "replica_name": "replica-a", "drain_delay_s": 1.5,
                  "grace_s": 10}


@pytest.fixture(scope="module")
def http(server):
    httpd = start_metrics_http("127.0.0.1", 0, server.metrics.registry, server.http_status)
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def get(url: str) -> tuple[int, dict | str]:
    def fetch() -> tuple[int, dict | str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as res:
                body = res.read().decode()
                return res.status, json.loads(body) if res.headers["Content-Type"] == "application/json" else body
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
    return await asyncio.to_thread(fetch)


def gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_capacity_is_a_metric_and_a_refusal_before_max_sessions(server, channel, http):
    code, metrics = await get(f"{http}/metrics")
    assert code == 200 and gauge(metrics, "rtmedia_sessions_capacity") == 2
    async with Conversation(channel) as a, Conversation(channel) as b:
        for c in (a, b):
            await c.wait_for("session.created")
        async with Conversation(channel) as over:
            await over.ended()
            assert over.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(over.error) == "AT_CAPACITY" and "capacity of 2" in over.error.details()
        _, state = await get(f"{http}/readyz")
        assert state["sessions"] == 2 and state["capacity"] == 2
        _, metrics = await get(f"{http}/metrics")
        assert gauge(metrics, "rtmedia_sessions_active") == 2


async def test_admit_over_capacity_keeps_capacity_as_a_metric_only(server, channel):
    server.realtime.refuse_at_capacity = False
    try:
        async with Conversation(channel) as a, Conversation(channel) as b, Conversation(channel) as c:
            for conversation in (a, b, c):
                await conversation.wait_for("session.created")
            async with Conversation(channel) as d, Conversation(channel) as over:
                await d.wait_for("session.created")
                await over.ended()
                assert error_reason(over.error) == "MAX_SESSIONS"  # max_sessions (4) still holds
    finally:
        server.realtime.refuse_at_capacity = True


async def test_every_session_names_its_replica(channel):
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        metadata = dict(await c.call.initial_metadata())
    assert metadata["rtmedia-replica"] == "replica-a"


def test_capacity_settings_parse_and_are_checked():
    args = build_parser().parse_args(["serve", "--capacity-sessions", "16", "--admit-over-capacity",
                                      "--drain-delay", "2", "--replica-name", "pod-1"])
    config = config_from_args(args)
    assert (
        config.limits.capacity_sessions,
        config.limits.refuse_at_capacity,
        config.network.drain_delay_s,
        config.network.replica_name,
    ) == (16, False, 2.0, "pod-1")
    with pytest.raises(ValueError, match=r"capacity_sessions must be within 0\.\.max_sessions"):
        ServerConfig.of(capacity_sessions=300)
    with pytest.raises(ValueError, match=r"drain_delay_s must be within 0\.\.grace_s"):
        ServerConfig.of(drain_delay_s=60)


async def test_rtmedia_health_checks_grpc_health(server):
    async def health(*args: str) -> subprocess.CompletedProcess:
        return await asyncio.to_thread(subprocess.run, [RTMEDIA, "health", "--target", f"127.0.0.1:{server.port}",
                                                        *args], capture_output=True, text=True, timeout=30)
    ok = await health()
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING")
    ok = await health("--service", "rtmedia.v1.RealtimeService", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"service": "rtmedia.v1.RealtimeService",
                                                            "status": "SERVING"}
    unknown = await health("--service", "no.such.Service")
    assert unknown.returncode == 1 and unknown.stderr.strip() == \
        "rtmedia health: the server has no service 'no.such.Service'"


async def test_drain_delay_is_not_ready_but_still_admits(server, channel, http):
    """Also: the drain waits for the reply in flight although the server had emptied before (the
    tests above closed all their sessions), which it once took for "all closed"."""
    code, state = await get(f"{http}/readyz")
    assert code == 200 and state["status"] == "serving"
    assert (await get(f"{http}/livez"))[0] == 200
    async with Conversation(channel) as held:
        await held.wait_for("session.created")
        held.send("conversation.item.create", item={"text": "a reply that is still playing " * 3})
        held.send("response.create")  # in flight through the drain: the server waits for it
        created = await held.wait_for("response.created")
        stopping = asyncio.create_task(server.stop())
        await until(lambda: server.state == "leaving" and not server.ready, what="the server leaving")
        code, state = await get(f"{http}/readyz")
        assert code == 503 and state["status"] == "draining" and not state["ready"]
        assert (await get(f"{http}/livez"))[0] == 200  # alive: it is finishing its sessions
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        async with Conversation(channel) as late:  # within the delay: admitted, not refused
            await late.wait_for("session.created")
        await until(lambda: server.realtime.draining, what="the drain delay's end")  # drain_delay_s
        async with Conversation(channel) as refused:
            await refused.ended()
            assert refused.error.code() == grpc.StatusCode.UNAVAILABLE and error_reason(refused.error) == "DRAINING"
        done = await held.wait_for("response.done", timeout=10)
        closed = await held.wait_for("session.closed", timeout=10)
        assert done["response_id"] == created["response_id"] and done["status"] == "completed"
        assert closed["reason"] == "server_shutdown"
        await stopping
    assert server.state == "stopped"

