"""Tokens on the bridge's web port, its credentials toward the server, reload and drain, in
process: the real Bridge (aiohttp, aiortc, grpc.aio) in front of a stand-in rtmedia server (a
grpc.aio RealtimeService that checks the metadata the way the real one does), or of no server
at all (`Peer.open_session` replaced) where only the HTTP front is under test.

Certificates are made here with the `cryptography` package."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from aiortc import RTCSessionDescription
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from rtmedia.protocol.errors import abort
from rtmedia.protocol.events import server_event
from rtmedia.protocol.tokens import TokenTable, parse_tokens
from rtmedia.v1 import realtime_pb2_grpc
from rtmedia.web.bridge import (
    TOKEN_KEY,
    WS_PROTOCOL_KEY,
    Bridge,
    BridgeConfig,
    server_credentials,
    start_beside,
)

from tests.support.waits import until
from tests.support.webrtc import BridgePeer

ALICE = "alice-secret-token-0123456789"
BOB = "bob-secret-token-9876543210xyz"
WRONG = "wrong-secret-token-555555555"
SERVER = "bridge-own-token-abcdefghijkl"
QUOTA = "quota-bound-token-zzzzzzzzzzzz"
SECRETS = (ALICE, BOB, WRONG, SERVER, QUOTA)


def table(*lines: str, path: str = "test") -> TokenTable:
    return TokenTable(parse_tokens("\n".join(lines), path))


@contextlib.asynccontextmanager
async def running(config: BridgeConfig, tokens: TokenTable | None = None) -> AsyncIterator[Bridge]:
    bridge = Bridge(config, tokens)
    await bridge.start()
    try:
        yield bridge
    finally:
        await bridge.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def connect(peer: BridgePeer, http: aiohttp.ClientSession, headers: dict[str, str]) -> tuple[int, dict, dict]:
    """BridgePeer.connect with request headers: (status, JSON body, response headers); on 200 the
    answer is applied."""
    sdp = await peer.offer_sdp()
    async with http.post(f"{peer.base_url}/offer", json={"sdp": sdp, "type": "offer"}, headers=headers) as res:
        body = await res.json()
        status, answer_headers = res.status, dict(res.headers)
    if status == 200:
        peer.peer_id = body["id"]
        await peer.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))
    return status, body, answer_headers


def assert_no_secret(texts: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """No token appears in any response text given, nor in any log record (message or fields)."""
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, text
    for record in caplog.records:
        dump = f"{record.getMessage()} {vars(record)}"
        for secret in SECRETS:
            assert secret not in dump, dump


# ---- 1. the middleware ------------------------------------------------------------------------------

async def test_tokens_guard_every_route_but_the_page_and_healthz(sessionless, caplog):
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    async with running(BridgeConfig(port=0), table(f"{ALICE} alice", f"{BOB} bob")) as bridge, \
            aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{bridge.port}"

        async def call(method: str, path: str, headers: dict[str, str] | None = None, **kw) -> tuple[int, str, dict]:
            async with http.request(method, url + path, headers=headers or {}, **kw) as res:
                text = await res.text()
                seen.append(text + json.dumps(dict(res.headers)))
                return res.status, text, dict(res.headers)

        # Open: the page, its files, the probes' /healthz; with or without (any) token.
        for path in ("/", "/static/app.js", "/static/style.css", "/healthz"):
            for headers in (None, bearer(WRONG), bearer(ALICE)):
                assert (await call("GET", path, headers))[0] == 200, path
        assert (await call("HEAD", "/"))[0] == 200

        # Guarded: everything else, without a token or with a wrong one, gets the same 401.
        guarded = [("GET", "/config"), ("POST", "/offer"), ("POST", "/whip"), ("OPTIONS", "/whip"),
                   ("GET", "/peers/anything"), ("DELETE", "/peers/anything"), ("DELETE", "/whip/anything"),
                   ("PATCH", "/whip/anything"), ("GET", "/no-such-route"), ("POST", "/healthz"), ("POST", "/")]
        answers = set()
        for method, path in guarded:
            for headers in (None, bearer(WRONG), {"Authorization": ALICE}, {"Authorization": f"Basic {ALICE}"},
                            bearer(ALICE + "x"), bearer(ALICE[:-1])):
                status, text, response_headers = await call(method, path, headers)
                assert status == 401, (method, path, headers, status, text)
                assert response_headers["WWW-Authenticate"] == "Bearer"
                assert response_headers["Content-Type"].startswith("application/json")
                answers.add(text)
        # One answer for every refusal: nothing tells a missing token from a wrong or near one.
        assert len(answers) == 1, answers
        body = json.loads(answers.pop())
        assert body == {"error": "authentication required: send Authorization: Bearer TOKEN",
                        "reason": "unauthenticated"}

        # With a token of the table: through, in either case of the scheme.
        status, text, _ = await call("GET", "/config", bearer(BOB))
        assert status == 200 and "ice_servers" in text
        assert (await call("GET", "/config", {"Authorization": f"bearer {ALICE}"}))[0] == 200
        assert (await call("GET", "/peers/nobody", bearer(ALICE)))[0] == 404  # through to the route

        # An offer: 401 without, answered with; the peer's stats and log lines carry the token's NAME.
        peer = BridgePeer(url)
        try:
            status, body, _ = await connect(peer, http, {})
            assert status == 401 and body["reason"] == "unauthenticated"
            await peer.close()
            peer = BridgePeer(url)
            status, body, _ = await connect(peer, http, bearer(ALICE))
            assert status == 200, body
            seen.append(json.dumps(body))
            status, text, _ = await call("GET", f"/peers/{peer.peer_id}", bearer(ALICE))
            assert status == 200 and json.loads(text)["token_name"] == "alice"
            assert (await call("GET", f"/peers/{peer.peer_id}"))[0] == 401  # the id alone is not enough now
            assert (await call("DELETE", f"/peers/{peer.peer_id}"))[0] == 401
            # Another token's holder who learnt the id sees no peer there.
            assert (await call("GET", f"/peers/{peer.peer_id}", bearer(BOB)))[0] == 404
            assert (await call("DELETE", f"/peers/{peer.peer_id}", bearer(BOB)))[0] == 404
            assert peer.peer_id in bridge.peers
            assert (await call("DELETE", f"/peers/{peer.peer_id}", bearer(ALICE)))[0] == 200
        finally:
            await peer.close()
        answered = [r for r in caplog.records if r.getMessage() == "peer answered"]
        closing = [r for r in caplog.records if r.getMessage() == "peer closing"]
        assert answered and answered[-1].token_name == "alice"
        assert closing and closing[-1].token_name == "alice"
        refused = [r for r in caplog.records if r.getMessage() == "request refused: no valid token"]
        assert refused and all(not hasattr(r, "token_name") for r in refused)
    assert_no_secret(seen, caplog)


async def test_without_tokens_the_routes_stay_open(sessionless):
    async with running(BridgeConfig(port=0), TokenTable()) as bridge, aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{bridge.port}/config") as res:
            assert res.status == 200
        peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
        try:
            status, body, _ = await connect(peer, http, {})
            assert status == 200, body
            assert bridge.peers[peer.peer_id].describe()["token_name"] is None
        finally:
            await peer.close()


async def test_a_websocket_handshake_may_carry_the_token_as_a_subprotocol(caplog):
    """Browsers cannot set headers on a WebSocket: the subprotocol rtmedia.bearer.TOKEN stands in
    for the Authorization header on a handshake (the bridge has no WebSocket route yet: the test
    adds one to the bridge's own app)."""
    caplog.set_level(logging.DEBUG)
    bridge = Bridge(BridgeConfig(port=0), table(f"{ALICE} alice"))
    app = bridge.app()
    names: list[str] = []

    async def socket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=[request[WS_PROTOCOL_KEY]] if WS_PROTOCOL_KEY in request else [])
        await ws.prepare(request)
        names.append(request[TOKEN_KEY].name if TOKEN_KEY in request else "")
        await ws.send_str("hello")
        await ws.close()
        return ws

    app.router.add_get("/ws", socket)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("/ws"))
    seen: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, protocols=["chat", f"rtmedia.bearer.{ALICE}"]) as ws:
                assert ws.protocol == f"rtmedia.bearer.{ALICE}"
                assert (await ws.receive_str()) == "hello"
            assert names == ["alice"]
            # The header works on a handshake too.
            async with http.ws_connect(url, headers=bearer(ALICE)) as ws:
                assert (await ws.receive_str()) == "hello"
            for protocols, headers in ((["chat"], {}), ([f"rtmedia.bearer.{WRONG}"], {}), (["rtmedia.bearer."], {}),
                                       ([], {})):
                with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                    await http.ws_connect(url, protocols=protocols, headers=headers)
                assert info.value.status == 401
                assert info.value.headers["WWW-Authenticate"] == "Bearer"
                seen.append(json.dumps(dict(info.value.headers)))
            # The subprotocol counts only on a handshake: a plain request must use the header.
            async with http.get(str(server.make_url("/config")),
                                headers={"Sec-WebSocket-Protocol": f"rtmedia.bearer.{ALICE}"}) as res:
                assert res.status == 401
                seen.append(await res.text())
    finally:
        await server.close()
    assert_no_secret(seen, caplog)


# ---- 2. reload: the certificate and the tokens -------------------------------------------------------

def self_signed(directory: Path, name: str) -> tuple[Path, Path, bytes]:
    """A self-signed certificate for 127.0.0.1: (cert path, key path, DER bytes)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path, cert.public_bytes(serialization.Encoding.DER)


async def served_certificate(port: int) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    return writer.get_extra_info("ssl_object").getpeercert(binary_form=True), reader, writer


async def healthz_over(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    return await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)


async def test_reload_swaps_the_certificate_for_new_handshakes_only(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    live_cert, live_key = tmp_path / "web.pem", tmp_path / "web.key"
    first_cert, first_key, first_der = self_signed(tmp_path, "first")
    second_cert, second_key, second_der = self_signed(tmp_path, "second")
    live_cert.write_bytes(first_cert.read_bytes())
    live_key.write_bytes(first_key.read_bytes())
    async with running(BridgeConfig(port=0, tls_cert=str(live_cert), tls_key=str(live_key))) as bridge:
        assert bridge.url.startswith("https://")
        der, reader, writer = await served_certificate(bridge.port)
        assert der == first_der
        try:
            # The files change and SIGHUP comes: new handshakes get the new certificate ...
            live_cert.write_bytes(second_cert.read_bytes())
            live_key.write_bytes(second_key.read_bytes())
            bridge.reload()
            der2, _, writer2 = await served_certificate(bridge.port)
            writer2.close()
            assert der2 == second_der
            # ... and a connection made before goes on as it was.
            assert (await healthz_over(reader, writer)).startswith(b"HTTP/1.1 200")
            assert writer.get_extra_info("ssl_object").getpeercert(binary_form=True) == first_der
        finally:
            writer.close()

        # A bad file: the old certificate stays, and one log line names the file.
        caplog.clear()
        live_cert.write_text("not a certificate\n")
        bridge.reload()
        der3, _, writer3 = await served_certificate(bridge.port)
        writer3.close()
        assert der3 == second_der
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(live_cert) in warnings[0].getMessage(), warnings
        # A key that is not the certificate's is a bad file too.
        live_cert.write_bytes(first_cert.read_bytes())
        live_key.write_bytes(second_key.read_bytes())
        bridge.reload()
        der4, _, writer4 = await served_certificate(bridge.port)
        writer4.close()
        assert der4 == second_der


async def test_reload_swaps_the_token_table(sessionless, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = tmp_path / "tokens"
    path.write_text(f"{ALICE} alice\n")
    async with running(BridgeConfig(port=0, auth_tokens=str(path))) as bridge, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{bridge.port}/config"

        async def status(token: str) -> int:
            async with http.get(url, headers=bearer(token)) as res:
                return res.status

        assert (await status(ALICE), await status(BOB)) == (200, 401)
        # `rtmedia web`'s SIGHUP: the file is read again.
        path.write_text(f"{BOB} bob\n")
        bridge.reload()
        assert (await status(ALICE), await status(BOB)) == (401, 200)
        # A bad file keeps the old table, with one line naming the file (not the token).
        caplog.clear()
        path.write_text(f"{ALICE} alice\nshort\n")
        bridge.reload()
        assert (await status(ALICE), await status(BOB)) == (401, 200)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), warnings
        path.unlink()
        bridge.reload()
        assert await status(BOB) == 200
        # Beside the server: the server's table, handed over.
        bridge.reload(table(f"{WRONG} other"))
        assert (await status(BOB), await status(WRONG)) == (401, 200)
        # An empty table turns authentication off.
        bridge.reload(TokenTable())
        assert await status("anything-at-all-here") == 200
    assert_no_secret([], caplog)


# ---- 3. toward the server: tokens per call, TLS, refusals ---------------------------------------------

@dataclass
class StandIn(realtime_pb2_grpc.RealtimeServiceServicer):
    """The server's edge: authorization metadata checked like rtmedia.server.security.auth does; a token
    over its quota refused with QUOTA; `full` refuses with MAX_SESSIONS; `end` closes every
    session with session.closed{server_shutdown}."""

    tokens: set[str]
    full: bool = False
    seen: list[str | None] = field(default_factory=list)
    peers: list[dict] = field(default_factory=list)
    end: asyncio.Event = field(default_factory=asyncio.Event)

    async def Converse(self, request_iterator, context):
        metadata = dict(context.invocation_metadata())
        auth = metadata.get("authorization")
        self.seen.append(auth)
        self.peers.append(context.auth_context())
        if auth == f"Bearer {QUOTA}":
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA",
                        "the token's limit of 2 new sessions a minute is reached", retry_after_s="7.2")
        if self.tokens and (auth is None or auth.removeprefix("Bearer ") not in self.tokens):
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                        "a valid bearer token is required (authorization metadata)")
        if self.full:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "MAX_SESSIONS", "at the limit of 1 sessions")
        # As the real server: session.created on admission, before any client event.
        await context.write(server_event("session.created", session_id=f"sess_{len(self.seen)}"))
        reading = asyncio.ensure_future(self._drain(request_iterator))
        await self.end.wait()
        await context.write(server_event("session.closed", reason="server_shutdown"))
        reading.cancel()

    async def _drain(self, request_iterator) -> None:
        async for _ in request_iterator:
            pass


@contextlib.asynccontextmanager
async def stand_in(servicer: StandIn, credentials: grpc.ServerCredentials | None = None) -> AsyncIterator[int]:
    server = grpc.aio.server()
    realtime_pb2_grpc.add_RealtimeServiceServicer_to_server(servicer, server)
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials
            else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    try:
        yield port
    finally:
        servicer.end.set()
        await server.stop(0)


async def test_sessions_carry_the_browsers_token_else_the_bridges(caplog):
    caplog.set_level(logging.DEBUG)
    servicer = StandIn({ALICE, SERVER})
    seen: list[str] = []
    async with stand_in(servicer) as port, aiohttp.ClientSession() as http:
        config = BridgeConfig(port=0, target=f"127.0.0.1:{port}", server_token=SERVER)
        async with running(config, table(f"{ALICE} alice", f"{BOB} bob", f"{QUOTA} quota")) as bridge:
            url = f"http://127.0.0.1:{bridge.port}"
            peers = [BridgePeer(url) for _ in range(3)]
            try:
                # The browser's token goes on to the server with the session.
                status, body, _ = await connect(peers[0], http, bearer(ALICE))
                assert status == 200, body
                await peers[0].wait_for("session.created")
                assert servicer.seen == [f"Bearer {ALICE}"]
                # The server refuses BOB (not in its table): 401 from the bridge, saying no more.
                status, body, headers = await connect(peers[1], http, bearer(BOB))
                assert status == 401 and body["reason"] == "unauthenticated", body
                assert headers["WWW-Authenticate"] == "Bearer"
                seen.append(json.dumps(body))
                # Over the token's quota: 429, Retry-After from the ErrorInfo's retry_after_s.
                status, body, headers = await connect(peers[2], http, bearer(QUOTA))
                assert status == 429 and body["reason"] == "quota" and headers["Retry-After"] == "8", (body, headers)
                assert "limit of 2 new sessions" in body["error"]
                seen.append(json.dumps(body))
                assert servicer.seen[1:] == [f"Bearer {BOB}", f"Bearer {QUOTA}"]
            finally:
                for peer in peers:
                    await peer.close()
        # Without tokens on the web port, a session carries --server-token ...
        async with running(config, TokenTable()) as bridge:
            peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
            try:
                status, body, _ = await connect(peer, http, {})
                assert status == 200, body
                assert servicer.seen[-1] == f"Bearer {SERVER}"
            finally:
                await peer.close()
            # ... unless the browser presented one: it is passed on, for the server to judge.
            peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
            try:
                status, body, _ = await connect(peer, http, bearer(WRONG))
                assert status == 401, body
                assert servicer.seen[-1] == f"Bearer {WRONG}"
            finally:
                await peer.close()
        # A full server stays 503, as before.
        servicer.full, servicer.tokens = True, set()
        async with running(BridgeConfig(port=0, target=f"127.0.0.1:{port}"), TokenTable()) as bridge:
            peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
            try:
                status, body, _ = await connect(peer, http, {})
                assert status == 503 and "MAX_SESSIONS" in body["error"], body
                assert servicer.seen[-1] is None  # no token at all
            finally:
                await peer.close()
    assert_no_secret(seen, caplog)


def ca_and_certs(directory: Path, ca_subject: str = "test CA") -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it."""
    def issue(subject: str, key, issuer: x509.Name, issuer_key, *, ca: bool = False, sans=None, usage=None):
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                         subject)]))
                   .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_subject)])
    ca = issue(ca_subject, ca_key, ca_name, ca_key, ca=True)
    server = issue("localhost", server_key, ca_name, ca_key,
                   sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                   usage=[ExtendedKeyUsageOID.SERVER_AUTH])
    client = issue("the-bridge", client_key, ca_name, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    files = {"ca": ca.public_bytes(serialization.Encoding.PEM),
             "server.pem": server.public_bytes(serialization.Encoding.PEM), "server.key": pem_key(server_key),
             "client.pem": client.public_bytes(serialization.Encoding.PEM), "client.key": pem_key(client_key)}
    paths = {}
    for name, data in files.items():
        paths[name] = directory / name
        paths[name].write_bytes(data)
    return paths


async def test_the_bridge_dials_the_server_over_mutual_tls(tmp_path):
    files = ca_and_certs(tmp_path)
    credentials = grpc.ssl_server_credentials([(files["server.key"].read_bytes(), files["server.pem"].read_bytes())],
                                              root_certificates=files["ca"].read_bytes(),
                                              require_client_auth=True)
    servicer = StandIn({ALICE})
    async with stand_in(servicer, credentials) as port, aiohttp.ClientSession() as http:
        config = BridgeConfig(port=0, target=f"127.0.0.1:{port}", server_ca=str(files["ca"]),
                              server_cert=str(files["client.pem"]), server_key=str(files["client.key"]))
        assert config.server_tls  # --server-ca implies it
        async with running(config, table(f"{ALICE} alice")) as bridge:
            peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
            try:
                status, body, _ = await connect(peer, http, bearer(ALICE))
                assert status == 200, body
                await peer.wait_for("session.created")
            finally:
                await peer.close()
        assert servicer.seen == [f"Bearer {ALICE}"]
        assert servicer.peers[0].get("x509_common_name") == [b"the-bridge"], servicer.peers[0]
        # Without its client certificate the handshake fails: the bridge cannot reach the server.
        async with running(BridgeConfig(port=0, target=f"127.0.0.1:{port}", server_ca=str(files["ca"])),
                           table(f"{ALICE} alice")) as bridge:
            peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
            try:
                status, body, _ = await connect(peer, http, bearer(ALICE))
                assert status in (502, 504) and len(servicer.seen) == 1, body
            finally:
                await peer.close()


async def test_reload_rereads_the_credentials_toward_the_server(tmp_path, caplog):
    """SIGHUP with --server-tls: new peers dial with the re-read client certificate, a live peer
    keeps its channel until it closes, and a bad file leaves the old credentials in force."""
    caplog.set_level(logging.INFO)
    (tmp_path / "first").mkdir(), (tmp_path / "second").mkdir()
    first, second = ca_and_certs(tmp_path / "first"), ca_and_certs(tmp_path / "second", "second CA")
    credentials = grpc.ssl_server_credentials([(first["server.key"].read_bytes(), first["server.pem"].read_bytes())],
                                              root_certificates=first["ca"].read_bytes() + second["ca"].read_bytes(),
                                              require_client_auth=True)
    live_cert, live_key = tmp_path / "client.pem", tmp_path / "client.key"
    live_cert.write_bytes(second["client.pem"].read_bytes())
    live_key.write_bytes(second["client.key"].read_bytes())
    servicer = StandIn(set())
    async with stand_in(servicer, credentials) as port, aiohttp.ClientSession() as http:
        config = BridgeConfig(port=0, target=f"127.0.0.1:{port}", server_ca=str(first["ca"]),
                              server_cert=str(live_cert), server_key=str(live_key))
        async with running(config, TokenTable()) as bridge:
            url = f"http://127.0.0.1:{bridge.port}"
            before, after = BridgePeer(url), BridgePeer(url)
            try:
                assert (await connect(before, http, {}))[0] == 200
                await before.wait_for("session.created")
                live_cert.write_bytes(first["client.pem"].read_bytes())
                live_key.write_bytes(first["client.key"].read_bytes())
                old = bridge.channel
                bridge.reload()
                assert bridge.channel is not old and bridge._retired == [old]  # the live peer still uses it
                assert (await connect(after, http, {}))[0] == 200
                await after.wait_for("session.created")
                presented = [p["x509_pem_cert"][0] for p in servicer.peers]
                assert presented == [second["client.pem"].read_bytes(), first["client.pem"].read_bytes()]
                assert bridge.peers[before.peer_id].grpc_channel is old
            finally:
                await before.close()
            # the peer's DELETE closes it; then its retired channel goes
            await until(lambda: not bridge._retired, what="the retired channel closing")
            assert bridge._retired == [] and after.peer_id in bridge.peers
            # A bad file: one line names it, and the channel stays.
            caplog.clear()
            live_key.write_text("not a key\n")
            channel = bridge.channel
            bridge.reload()
            assert bridge.channel is channel
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and str(live_key) in warnings[0].getMessage(), warnings
            await after.close()


# ---- 4. drain -------------------------------------------------------------------------------------------

async def test_drain_refuses_new_offers_while_live_sessions_finish(caplog):
    caplog.set_level(logging.INFO)
    servicer = StandIn({ALICE})
    async with stand_in(servicer) as port, aiohttp.ClientSession() as http:
        bridge = Bridge(BridgeConfig(port=0, target=f"127.0.0.1:{port}"), table(f"{ALICE} alice"))
        await bridge.start()
        url = f"http://127.0.0.1:{bridge.port}"
        live, late = BridgePeer(url), BridgePeer(url)
        try:
            status, body, _ = await connect(live, http, bearer(ALICE))
            assert status == 200, body
            await live.wait_for("bridge.peer")
            draining = asyncio.create_task(bridge.drain(30))
            await until(lambda: bridge.draining, what="the bridge draining")
            # New offers: 503, Retry-After, reason draining; /healthz says so.
            status, body, headers = await connect(late, http, bearer(ALICE))
            assert status == 503 and body["reason"] == "draining" and int(headers["Retry-After"]) >= 1, body
            async with http.get(f"{url}/healthz") as res:
                health = await res.json()
            assert health["draining"] is True and health["peers"] == 1
            # The live call goes on ...
            assert not draining.done() and live.peer_id in bridge.peers
            live.send({"type": "input_audio_buffer.clear"})
            # ... until the server ends its session (after the turn in flight): then the bridge stops.
            servicer.end.set()
            await asyncio.wait_for(draining, 10)
            assert not bridge.peers and bridge.stopped.is_set()
            reasons = [r.reason for r in caplog.records if r.getMessage() == "peer closing"]
            assert reasons == ["session ended"], reasons
        finally:
            await live.close()
            await late.close()
            await bridge.stop()


async def test_drain_closes_what_is_left_at_the_grace_deadline(sessionless):
    bridge = Bridge(BridgeConfig(port=0), TokenTable())
    await bridge.start()
    peer = BridgePeer(f"http://127.0.0.1:{bridge.port}")
    try:
        async with aiohttp.ClientSession() as http:
            assert (await connect(peer, http, {}))[0] == 200
        served = bridge.peers[peer.peer_id]
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(bridge.drain(0.5), 10)
        assert 0.4 < asyncio.get_running_loop().time() - started < 8
        assert served.closed.is_set() and served.close_reason == "bridge shutting down"
        await bridge.stop()  # idempotent
    finally:
        await peer.close()


async def test_start_beside_takes_the_servers_target_and_tokens(sessionless):
    from rtmedia.web.settings import TwilioSettings, WebSettings

    web = WebSettings(enabled=True, port=0, max_peers=3, openai_api=False)  # `serve --no-openai-api`
    tokens = table(f"{ALICE} alice")
    bridge = await start_beside(web, TwilioSettings(), "127.0.0.1", "unix:/nonexistent/grpc.sock", tokens)
    try:
        assert bridge.config.target == "unix:/nonexistent/grpc.sock" and bridge.config.max_peers == 3
        assert bridge.tokens is tokens and bridge.config.forwards_tokens
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{bridge.port}/config") as res:
                assert res.status == 401
            bridge.reload(table(f"{BOB} bob"))
            async with http.get(f"http://127.0.0.1:{bridge.port}/config", headers=bearer(BOB)) as res:
                assert res.status == 200
            async with http.get(f"http://127.0.0.1:{bridge.port}/v1/models", headers=bearer(BOB)) as res:
                assert res.status == 404 and (await res.json())["error"]["type"] == "invalid_request_error"
        assert bridge.config.openai is None and bridge.openai is None
    finally:
        await bridge.stop()


async def test_the_openai_api_wants_a_token_and_answers_in_its_shape(sessionless):
    """/v1/ is behind the web port's tokens; its refusals are OpenAI's error objects."""
    bridge = Bridge(BridgeConfig(target="unix:/nonexistent/grpc.sock", port=0), table(f"{ALICE} alice"))
    await bridge.start()
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{bridge.port}/v1/models"
            async with http.get(url) as res:
                body = await res.json()
                assert res.status == 401 and res.headers["WWW-Authenticate"] == "Bearer"
                assert body["error"]["code"] == "invalid_api_key" and body["error"]["message"]
            async with http.get(url, headers=bearer(ALICE)) as res:
                assert res.status == 200 and "tts-1" in {m["id"] for m in (await res.json())["data"]}
            async with http.delete(url, headers=bearer(ALICE)) as res:
                assert res.status == 405 and (await res.json())["error"]["type"] == "invalid_request_error"
            async with http.get(f"{url}/no-such-model", headers=bearer(ALICE)) as res:
                assert res.status == 404 and (await res.json())["error"]["code"] == "model_not_found"
    finally:
        await bridge.stop()


def test_server_credential_files_are_checked_at_start(tmp_path):
    files = ca_and_certs(tmp_path)
    assert server_credentials(BridgeConfig()) is None
    assert server_credentials(BridgeConfig(server_tls=True)) is not None  # the system's roots
    assert server_credentials(BridgeConfig(server_ca=str(files["ca"]), server_cert=str(files["client.pem"]),
                                           server_key=str(files["client.key"]))) is not None
    with pytest.raises(ValueError, match="cannot read --server-ca"):
        server_credentials(BridgeConfig(server_ca=str(tmp_path / "missing.pem")))
    with pytest.raises(ValueError, match=r"--server-key .*private key"):
        server_credentials(BridgeConfig(server_cert=str(files["client.pem"]), server_key=str(files["ca"])))
