"""The client commands' TLS, mutual TLS and bearer-token flags (rtmedia.clients.credentials):
parsing, one-line errors, no token in plaintext off this machine, and the `authorization`
metadata as a real in-process grpc.aio server receives it over plaintext, TLS and mutual TLS."""

from __future__ import annotations

import argparse
import asyncio
import re

import grpc
import pytest
import pytest_asyncio
from rtmedia.clients.commands import cli as client_cli
from rtmedia.clients.credentials import (
    TOKEN_ENV,
    Credentials,
    CredentialsError,
    from_args,
)
from rtmedia.protocol.errors import rich_status
from rtmedia.protocol.tokens import is_loopback
from rtmedia.protocol.tokens import target_host as host_of
from rtmedia.v1 import speech_pb2

from tests.support.certs import Certs, make_certs
from tests.support.serve import free_port

TOKEN = "good-token-0123456789"
QUOTA_TOKEN = "quota-token-0123456789"
COMMANDS = {  # every client command that opens a channel, with its required arguments
    "voices": [], "synth": ["hi", "-o", "out.wav"], "transcribe": ["in.wav"], "talk": ["in.wav"],
    "decode-video": ["lat.npy"], "loadtest": [],
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtmedia")
    client_cli.add_commands(p.add_subparsers(dest="command"))
    return p


def parse(command: str, *argv: str) -> argparse.Namespace:
    return parser().parse_args([command, *COMMANDS[command], *argv])


# ---- an in-process server that shows what it received ---------------------------------------------

def _authorization(context: grpc.aio.ServicerContext) -> bytes:
    return dict(context.invocation_metadata()).get("authorization", "").encode()


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return _authorization(context)


async def _replies(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    yield _authorization(context)


async def _stream(requests, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    async for _ in requests:
        yield _authorization(context)


async def _list_voices(request: speech_pb2.ListVoicesRequest,
                       context: grpc.aio.ServicerContext) -> speech_pb2.ListVoicesResponse:
    auth = _authorization(context).decode()
    if auth == f"Bearer {QUOTA_TOKEN}":
        await context.abort_with_status(rich_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA", "the token's limit of 1 new sessions a minute is reached",
            retry_after_s="7"))
    if auth != f"Bearer {TOKEN}":
        await context.abort_with_status(rich_status(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                                                    "no valid bearer token"))
    return speech_pb2.ListVoicesResponse(voices=[speech_pb2.Voice(name="test-voice", language="en")])


HANDLER = grpc.method_handlers_generic_handler("test.Echo", {
    "Unary": grpc.unary_unary_rpc_method_handler(_unary),
    "Replies": grpc.unary_stream_rpc_method_handler(_replies),
    "Stream": grpc.stream_stream_rpc_method_handler(_stream),
})
SPEECH = grpc.method_handlers_generic_handler("rtmedia.v1.SpeechService", {
    "ListVoices": grpc.unary_unary_rpc_method_handler(
        _list_voices, request_deserializer=speech_pb2.ListVoicesRequest.FromString,
        response_serializer=speech_pb2.ListVoicesResponse.SerializeToString),
})


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest_asyncio.fixture(scope="module")
async def ports(certs):
    """{"plain", "tls", "mtls"}: 127.0.0.1 targets of one server (mtls requires a client certificate)."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([HANDLER, SPEECH])
    pair = [(certs.server_key.read_bytes(), certs.server_cert.read_bytes())]
    ca = certs.ca.read_bytes()
    found = {
        "plain": server.add_insecure_port("127.0.0.1:0"),
        "tls": server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair)),
        "mtls": server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            pair, root_certificates=ca, require_client_auth=True)),
    }
    await server.start()
    yield {kind: f"127.0.0.1:{port}" for kind, port in found.items()}
    await server.stop(None)


def sync_calls(creds: Credentials, target: str) -> list[bytes]:
    """What the server received, through a sync channel: a unary call, a reply stream, a bidi stream."""
    with creds.channel(target) as channel:
        unary = channel.unary_unary("/test.Echo/Unary")(b"", timeout=10)
        replies = list(channel.unary_stream("/test.Echo/Replies")(b"", timeout=10))
        stream = list(channel.stream_stream("/test.Echo/Stream")(iter([b"", b""]), timeout=10))
    return [unary, *replies, *stream]


async def aio_calls(creds: Credentials, target: str) -> list[bytes]:
    """The same through a grpc.aio channel, the stream written as talk and loadtest write it."""
    channel = creds.aio_channel(target)
    try:
        unary = await channel.unary_unary("/test.Echo/Unary")(b"", timeout=10)
        replies = [m async for m in channel.unary_stream("/test.Echo/Replies")(b"", timeout=10)]
        call = channel.stream_stream("/test.Echo/Stream")(timeout=10)
        await call.write(b"")
        first = await call.read()
        await call.write(b"")
        await call.done_writing()
        second = await call.read()
        assert await call.read() == grpc.aio.EOF
    finally:
        await channel.close()
    return [unary, *replies, first, second]


# ---- flags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_client_command_takes_the_flags(command, certs):
    args = parse(command, "--ca", str(certs.ca), "--cert", str(certs.client_cert), "--key", str(certs.client_key),
                 "--token", TOKEN)
    creds = from_args(args)
    assert creds.tls and creds.mutual and creds.token == TOKEN
    assert creds.root_certificates == certs.ca.read_bytes()
    assert creds.describe() == "with mutual TLS"


def test_defaults_and_implications(certs, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert from_args(parse("voices")) == Credentials()
    assert from_args(parse("voices", "--tls")) == Credentials(tls=True)
    assert from_args(parse("voices", "--ca", str(certs.ca))).tls  # --ca implies --tls
    assert from_args(parse("voices", "--cert", str(certs.client_cert), "--key", str(certs.client_key))).tls
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert from_args(parse("voices")).token == TOKEN  # the default comes from the environment
    assert from_args(parse("voices", "--token", "other-token-0123456789")).token == "other-token-0123456789"
    assert from_args(parse("voices", "--token", "")).token is None  # --token "" sends none


@pytest.mark.parametrize(("argv", "message"), [
    (["--cert", "c.pem"], "--cert and --key go together: give both for mutual TLS, or neither"),
    (["--key", "k.pem"], "--cert and --key go together: give both for mutual TLS, or neither"),
    (["--ca", "missing.pem"], "cannot read --ca missing.pem: No such file or directory"),
    (["--token", "has space"], "--token: a token is printable ASCII without spaces"),
    (["--token", TOKEN, "--target", "example.com:50051"],
     "refusing to send a token in plaintext to example.com; use --tls"),
    (["--token", TOKEN, "--target", "10.0.0.7:50051"], "refusing to send a token in plaintext to 10.0.0.7; use --tls"),
    (["--token", TOKEN, "--target", "dns:///rtmedia.internal:443"],
     "refusing to send a token in plaintext to rtmedia.internal; use --tls"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    args = parse("voices", *argv)
    with pytest.raises(CredentialsError, match=re.escape(message)):
        from_args(args)
    assert client_cli.run(args) == 1
    err = capsys.readouterr().err
    assert err == f"rtmedia voices: {message}\n"


def test_a_file_that_is_not_pem(tmp_path, certs):
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(CredentialsError, match=r"--ca .*junk.pem: not a PEM file holding a certificate"):
        from_args(parse("voices", "--ca", str(tmp_path / "junk.pem")))
    with pytest.raises(CredentialsError, match=r"--key .*client.pem: not a PEM file holding a private key"):
        from_args(parse("voices", "--cert", str(certs.client_cert), "--key", str(certs.client_cert)))


@pytest.mark.parametrize(("target", "host", "loopback"), [
    ("127.0.0.1:50051", "127.0.0.1", True), ("localhost:50051", "localhost", True), ("[::1]:50051", "::1", True),
    ("ipv4:127.0.0.1:50051", "127.0.0.1", True), ("ipv6:[::1]:50051", "::1", True),
    ("dns:///localhost:50051", "localhost", True), ("unix:/tmp/rtmedia.sock", "localhost", True),
    ("127.0.0.2:1", "127.0.0.2", True), ("10.0.0.7:50051", "10.0.0.7", False), ("example.com", "example.com", False),
    ("dns://8.8.8.8/rtmedia.example:443", "rtmedia.example", False), ("[2001:db8::1]:443", "2001:db8::1", False),
])
def test_target_hosts(target, host, loopback):
    assert host_of(target) == host
    assert is_loopback(host) is loopback


def test_a_token_goes_in_plaintext_only_to_loopback():
    Credentials(token=TOKEN).check("127.0.0.1:1")
    Credentials(tls=True, token=TOKEN).check("example.com:443")
    with pytest.raises(CredentialsError, match=r"refusing to send a token in plaintext to example\.com"):
        Credentials(token=TOKEN).channel("example.com:443")
    with pytest.raises(CredentialsError, match=r"refusing to send a token in plaintext to example\.com"):
        Credentials(token=TOKEN).aio_channel("example.com:443")


# ---- what the server receives -----------------------------------------------------------------------

async def test_plaintext_token_is_added_by_the_interceptor(ports):
    bearer = f"Bearer {TOKEN}".encode()
    assert await asyncio.to_thread(sync_calls, Credentials(token=TOKEN), ports["plain"]) == [bearer] * 4
    assert await aio_calls(Credentials(token=TOKEN), ports["plain"]) == [bearer] * 4
    assert await aio_calls(Credentials(), ports["plain"]) == [b""] * 4


async def test_token_over_tls(ports, certs):
    creds = Credentials(tls=True, root_certificates=certs.ca.read_bytes(), token=TOKEN)
    bearer = f"Bearer {TOKEN}".encode()
    assert await asyncio.to_thread(sync_calls, creds, ports["tls"]) == [bearer] * 4
    assert await aio_calls(creds, ports["tls"]) == [bearer] * 4


async def test_mutual_tls(ports, certs):
    args = parse("voices", "--target", ports["mtls"], "--ca", str(certs.ca), "--cert", str(certs.client_cert),
                 "--key", str(certs.client_key), "--token", TOKEN)
    assert await aio_calls(from_args(args), ports["mtls"]) == [f"Bearer {TOKEN}".encode()] * 4
    no_cert = Credentials(tls=True, root_certificates=certs.ca.read_bytes(), token=TOKEN)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await aio_calls(no_cert, ports["mtls"])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_server_with_another_ca_is_refused(ports, tmp_path):
    other = make_certs(tmp_path / "other")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await aio_calls(Credentials(tls=True, root_certificates=other.ca.read_bytes()), ports["tls"])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- the CLI's lines for the server's refusals ----------------------------------------------------

async def cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    args = parser().parse_args(list(argv))
    code = await asyncio.to_thread(client_cli.run, args)  # the server runs on this thread's loop
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


async def test_cli_refusals_are_one_line(ports, certs, capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    tls = ["--target", ports["tls"], "--ca", str(certs.ca)]
    assert await cli(capsys, "voices", *tls, "--token", TOKEN) == (0, ["test-voice  en  native 0 Hz  rates: "], [])
    assert await cli(capsys, "voices", "--target", ports["plain"], "--token", TOKEN) == (
        0, ["test-voice  en  native 0 Hz  rates: "], [])
    assert await cli(capsys, "voices", *tls, "--token", "wrong-token-0123456789") == (1, [], [
        "rtmedia voices: the server refused the token (UNAUTHENTICATED): no valid bearer token"])
    assert await cli(capsys, "voices", *tls) == (1, [], [
        "rtmedia voices: the server wants a token (UNAUTHENTICATED): no valid bearer token; "
        f"give --token or set {TOKEN_ENV}"])
    assert await cli(capsys, "voices", *tls, "--token", QUOTA_TOKEN) == (1, [], [
        "rtmedia voices: over the token's quota (QUOTA): the token's limit of 1 new sessions a minute is "
        "reached; retry in 7 s"])


async def test_cli_without_a_client_certificate(ports, certs, capsys):
    code, out, err = await cli(capsys, "voices", "--target", ports["mtls"], "--ca", str(certs.ca), "--timeout", "10")
    assert code == 1 and out == [] and len(err) == 1, err
    assert err[0].startswith("rtmedia voices: UNAVAILABLE: ")
    assert err[0].endswith("; if the server requires a client certificate, give --cert and --key"), err


async def test_cli_in_plaintext_to_a_tls_server(ports, capsys):
    code, _, err = await cli(capsys, "voices", "--target", ports["tls"], "--timeout", "10")
    assert code == 1 and len(err) == 1 and err[0].startswith("rtmedia voices: UNAVAILABLE: "), err
    assert err[0].endswith("; if the server uses TLS, give --tls (and --ca FILE for a private CA)"), err
    nobody = f"127.0.0.1:{free_port()}"
    code, _, err = await cli(capsys, "voices", "--target", nobody, "--timeout", "10")
    assert code == 1 and len(err) == 1 and "Connection refused" in err[0] and "--tls" not in err[0], err



async def test_cli_with_tls_to_a_plaintext_server(ports, certs, capsys):
    code, _, err = await cli(capsys, "voices", "--target", ports["plain"], "--ca", str(certs.ca), "--timeout", "10")
    assert code == 1 and len(err) == 1 and err[0].startswith("rtmedia voices: UNAVAILABLE: "), err
    assert "handshake failed" in err[0] and "--cert" not in err[0], err
