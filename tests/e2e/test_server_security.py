"""TLS, mutual TLS, tokens, quotas and SIGHUP reloads on a real `rtmedia serve`.

Certificates are made for each test (tests/support/certs.py); the clients are grpc's own."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rtmedia.protocol.errors import error_metadata, error_reason
from rtmedia.v1 import speech_pb2, speech_pb2_grpc

from tests.support.certs import make_certs
from tests.support.converse import Conversation
from tests.support.serve import FEW_SPEAKERS, running_server
from tests.support.waits import until

pytestmark = pytest.mark.e2e

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"
CAROL = "carol-token-0123456789abcdef"
SERVE = ("--metrics-port", "0", "--no-llm", "--responder", "echo", "--no-riva")


def credentials(certs, client: bool = False) -> grpc.ChannelCredentials:
    ca = certs.ca.read_bytes()
    if not client:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, certs.client_key.read_bytes(), certs.client_cert.read_bytes())


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


async def health(target: str, creds: grpc.ChannelCredentials | None) -> int:
    async with (grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def served_certificate(target: str) -> bytes:
    host, port = target.rsplit(":", 1)
    return ssl.get_server_certificate((host, int(port))).encode()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"# name, then limits\n{ALICE} alice max_sessions=1\n{BOB} bob sessions_per_minute=2\n")
    with running_server(*SERVE, "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                        "--auth-tokens", str(tokens), credentials=credentials(certs),
                        asr_decoders=FEW_SPEAKERS) as (target, process):
        yield target, process, certs, tokens


async def test_tls_accepts_its_ca_and_refuses_others(tls_server, tmp_path):
    target, _, certs, _ = tls_server
    assert await health(target, credentials(certs)) == health_pb2.HealthCheckResponse.SERVING
    other = make_certs(tmp_path / "other")
    for creds in (credentials(other), None):  # a CA that did not sign it; plaintext to a TLS port
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health(target, creds)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tokens_and_quotas(tls_server):
    target, _, certs, _ = tls_server
    async with grpc.aio.secure_channel(target, credentials(certs)) as channel:
        speech = speech_pb2_grpc.SpeechServiceStub(channel)
        request = speech_pb2.ListVoicesRequest()
        for metadata in ((), bearer("not-a-token-0123456789"), (("authorization", ALICE),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await speech.ListVoices(request, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error_reason(refused.value) == "UNAUTHENTICATED"
            assert ALICE not in (refused.value.details() or "")
        assert (await speech.ListVoices(request, metadata=bearer(ALICE))).voices
        # reflection needs a token too; health does not (above)
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        # Read before writing: an aio client's write racing the refusal can turn the server's status
        # into INTERNAL "Internal error from Core" (grpc/grpc#36066); the refusal needs no request.
        refused_call = reflect.ServerReflectionInfo()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await refused_call.read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async for reply in reflect.ServerReflectionInfo(iter([ask]), metadata=bearer(ALICE)):
            assert reply.list_services_response.service
        # alice: one session at a time
        async with Conversation(channel, bearer(ALICE)) as first, Conversation(channel, bearer(ALICE)) as second:
            await first.wait_for("session.created")
            await second.ended()
            assert second.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(second.error) == "QUOTA"
        for attempt in range(50):  # the first one closed: room again, once the server has released it
            async with Conversation(channel, bearer(ALICE)) as again:
                with contextlib.suppress(AssertionError):
                    await again.wait_for("session.created")
                    break
                assert error_reason(again.error) == "QUOTA" and attempt < 49, again.error
            await asyncio.sleep(0.1)
        # bob: two new sessions a minute
        for n in range(3):
            async with Conversation(channel, bearer(BOB)) as c:
                if n < 2:
                    await c.wait_for("session.created")
                else:
                    await c.ended()
                    assert c.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert error_reason(c.error) == "QUOTA"
                    assert 1 <= float(error_metadata(c.error)["retry_after_s"]) <= 60


async def test_sighup_swaps_certificate_and_tokens_under_a_live_session(tls_server, tmp_path):
    target, process, certs, tokens = tls_server
    before = served_certificate(target)
    async with grpc.aio.secure_channel(target, credentials(certs)) as channel, \
            Conversation(channel, bearer(ALICE)) as live:
        await live.wait_for("session.created")
        live.send("conversation.item.create", item={"text": "before the reload"})
        live.send("response.create")
        await live.wait_for("response.done")
        fresh = make_certs(tmp_path / "fresh")
        certs.server_cert.write_bytes(fresh.server_cert.read_bytes())
        certs.server_key.write_bytes(fresh.server_key.read_bytes())
        tokens.write_text(f"{CAROL} carol\n{ALICE} alice max_sessions=1\n")
        process.send_signal(signal.SIGHUP)
        await until(lambda: served_certificate(target) != before, interval=0.2, what="the reloaded certificate")
        assert served_certificate(target) != before
        # the live session goes on talking over its old connection
        live.send("conversation.item.create", item={"text": "after the reload"})
        live.send("response.create")
        await live.wait_for("response.done", count=2)
        assert live.error is None
    async with grpc.aio.secure_channel(target, credentials(fresh)) as channel:
        speech = speech_pb2_grpc.SpeechServiceStub(channel)
        assert (await speech.ListVoices(speech_pb2.ListVoicesRequest(), metadata=bearer(CAROL))).voices
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # bob's token is gone
            await speech.ListVoices(speech_pb2.ListVoicesRequest(), metadata=bearer(BOB))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_mutual_tls_needs_a_client_certificate(tmp_path):
    certs = make_certs(tmp_path / "certs")
    with running_server(*SERVE, "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                        "--tls-client-ca", str(certs.ca), credentials=credentials(certs, client=True),
                        asr_decoders=FEW_SPEAKERS) as (target, _):
        assert asyncio.run(health(target, credentials(certs, client=True))) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(health(target, credentials(certs)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bad_tls_and_token_files_are_one_line_errors(tmp_path):
    import subprocess

    from tests.support.serve import RTMEDIA

    bad = tmp_path / "tokens"
    bad.write_text("short\n")
    certs = make_certs(tmp_path / "certs")
    for args, words in (
            (["--tls-cert", str(certs.server_cert)], "tls_cert and tls_key go together"),
            (["--tls-cert", str(certs.server_key), "--tls-key", str(certs.server_key)], "not a PEM certificate"),
            (["--tls-cert", str(tmp_path / "missing"), "--tls-key", str(certs.server_key)], "missing"),
            (["--auth-tokens", str(bad)], "line 1: a token is at least 16 characters")):
        result = subprocess.run([RTMEDIA, "serve", "--port", "0", *SERVE, *args], capture_output=True, text=True,
                                timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1, result.stderr
        assert lines[0].startswith("rtmedia serve: ") and words in lines[0], lines[0]
        assert "short" not in lines[0]
