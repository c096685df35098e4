"""Tokens, reload and drain between real processes: `rtmedia web --auth-tokens FILE` in front of
a real `rtmedia serve` (echo responder), an aiortc peer as the browser. Where the server itself
checks tokens (`rtmedia serve --auth-tokens`), the bridge's credentials toward it too: the
browser's token passed on, --server-token, the server's refusals as 401 and 429, and the
bridge beside the server (`serve --web`) on the server's own table."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiortc import RTCSessionDescription

from tests.support.serve import FEW_SPEAKERS, RTMEDIA, free_port, running_server
from tests.support.waits import until, until_sync
from tests.support.webrtc import BridgePeer, wait_http

pytestmark = pytest.mark.e2e
ALICE = "alice-e2e-token-0123456789abcdef"
BOB = "bob-e2e-token-fedcba9876543210"
QUOTA = "quota-e2e-token-11112222333344445555"
WRONG = "wrong-e2e-token-99998888777766665555"
SECRETS = (ALICE, BOB, QUOTA, WRONG)
TOKENS = f"{ALICE} alice\n{BOB} bob\n{QUOTA} quota sessions_per_minute=1\n"
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("RTMEDIA_TOKEN", "RTMEDIA_AUTH_TOKENS")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One `rtmedia serve --no-llm --responder echo`; where it can, with the token file and the
    bridge beside it (--web)."""
    directory = tmp_path_factory.mktemp("web-auth")
    tokens = directory / "tokens.txt"
    tokens.write_text(TOKENS)
    web_port = free_port()
    log = directory / "serve.log"
    with running_server("--no-llm", "--responder", "echo", "--metrics-port", "0", "--grace", "2", "--auth-tokens",
                        str(tokens), "--web", "--web-port", str(web_port), log=log,
                        asr_decoders=FEW_SPEAKERS) as (target, process):
        wait_http(f"http://127.0.0.1:{web_port}/healthz", process)
        yield {"target": target, "tokens": tokens, "log": log, "dir": directory, "web": f"http://127.0.0.1:{web_port}"}
    assert_no_secret(log.read_text(errors="replace"))


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text[-3000:]


@contextlib.contextmanager
def rtmedia_web(target: str, log: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rtmedia web --target TARGET EXTRA` on a free port, once /healthz answers: (URL, process);
    its output goes to `log`, which must never hold a token."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen([RTMEDIA, "web", "--target", target, "--port", str(port), *extra],
                                   stdout=out, stderr=subprocess.STDOUT, env={**CLEAN_ENV, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", process)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        assert_no_secret(log.read_text(errors="replace"))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def offer(peer: BridgePeer, http: aiohttp.ClientSession, headers: dict[str, str]) -> tuple[int, dict, dict]:
    """POST /offer with `headers` as the page does: (status, JSON body, headers); on 200 the
    answer is applied."""
    sdp = await peer.offer_sdp()
    async with http.post(f"{peer.base_url}/offer", json={"sdp": sdp, "type": "offer"}, headers=headers) as res:
        body = await res.json()
        status, answer_headers = res.status, dict(res.headers)
    assert_no_secret(str(body) + str(answer_headers))
    if status == 200:
        peer.peer_id = body["id"]
        await peer.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))
    return status, body, answer_headers


def test_an_offer_needs_a_token_on_the_web_port(server, tmp_path):
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as http:
            for path in ("/", "/static/app.js", "/healthz"):
                async with http.get(url + path) as res:
                    assert res.status == 200, path
            async with http.get(f"{url}/config") as res:
                assert res.status == 401 and res.headers["WWW-Authenticate"] == "Bearer"
            for headers in ({}, bearer(WRONG)):
                peer = BridgePeer(url)
                try:
                    status, body, answer_headers = await offer(peer, http, headers)
                    assert status == 401 and body["reason"] == "unauthenticated", body
                    assert answer_headers["WWW-Authenticate"] == "Bearer"
                finally:
                    await peer.close()
            peer = BridgePeer(url)
            try:
                status, body, _ = await offer(peer, http, bearer(ALICE))
                assert status == 200, body
                await peer.wait_for("session.created")
                await peer.wait_for("bridge.peer")
                async with http.get(f"{url}/peers/{peer.peer_id}", headers=bearer(ALICE)) as res:
                    stats = await res.json()
                assert stats["token_name"] == "alice", stats
                async with http.get(f"{url}/peers/{peer.peer_id}") as res:
                    assert res.status == 401
                async with http.delete(f"{url}/peers/{peer.peer_id}", headers=bearer(ALICE)) as res:
                    assert res.status == 200
            finally:
                await peer.close()

    with rtmedia_web(server["target"], tmp_path / "web.log", "--auth-tokens", str(server["tokens"])) as (url, _):
        asyncio.run(check(url))


def test_sighup_rereads_the_token_file(server, tmp_path):
    tokens = tmp_path / "web-tokens.txt"
    tokens.write_text(f"{ALICE} alice\n")

    async def status(url: str, token: str) -> int:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/config", headers=bearer(token)) as res:
            return res.status

    async def wait_status(url: str, token: str, wanted: int) -> None:
        got = []

        async def answered() -> bool:
            got.append(await status(url, token))
            return got[-1] == wanted

        await until(answered, interval=0.1, what=f"{token[:5]}...: {wanted}", seen=lambda: got[-1])

    log = tmp_path / "web.log"
    with rtmedia_web(server["target"], log, "--auth-tokens", str(tokens)) as (url, process):
        assert asyncio.run(status(url, ALICE)) == 200 and asyncio.run(status(url, BOB)) == 401
        tokens.write_text(f"{BOB} bob\n")
        process.send_signal(signal.SIGHUP)
        asyncio.run(wait_status(url, BOB, 200))
        assert asyncio.run(status(url, ALICE)) == 401
        tokens.write_text("too-short\n")  # a bad file: the old table stays
        process.send_signal(signal.SIGHUP)
        until_sync(lambda: str(tokens) in log.read_text(errors="replace"), interval=0.1,
                   what="the bad token file named in the log", seen=log.read_text)
        assert asyncio.run(status(url, BOB)) == 200 and process.poll() is None


def test_sigterm_drains_the_bridge(server, tmp_path):
    """SIGTERM: new offers get 503 (Retry-After, reason draining) while the live call goes on;
    once it has ended the process exits cleanly."""
    log = tmp_path / "web.log"

    async def check(url: str, process: subprocess.Popen) -> None:
        async with aiohttp.ClientSession() as http:
            live, late = BridgePeer(url), BridgePeer(url)
            try:
                status, body, _ = await offer(live, http, bearer(ALICE))
                assert status == 200, body
                await live.wait_for("session.created")
                await live.wait_for("bridge.peer")
                process.send_signal(signal.SIGTERM)
                health: dict = {}

                async def draining() -> bool:
                    async with http.get(f"{url}/healthz") as res:
                        health.update(await res.json())
                    return health["draining"]

                await until(draining, interval=0.1, what="/healthz draining", seen=lambda: health)
                assert health["peers"] == 1
                status, body, headers = await offer(late, http, bearer(ALICE))
                assert status == 503 and body["reason"] == "draining", body
                assert int(headers["Retry-After"]) >= 1
                # The live call goes on: its session still answers.
                live.send({"type": "session.update", "event_id": "during-drain",
                           "session": {"instructions": "still here"}})
                await live.wait_for("session.updated", count=2)
                assert process.poll() is None
                async with http.delete(f"{url}/peers/{live.peer_id}", headers=bearer(ALICE)) as res:
                    assert res.status == 200
            finally:
                await late.close()
                await live.close()

    with rtmedia_web(server["target"], log, "--auth-tokens", str(server["tokens"]), "--grace", "60") as (url, process):
        asyncio.run(check(url, process))
        assert process.wait(20) == 0, log.read_text()
    assert "draining" in log.read_text()


def test_the_servers_tokens_reach_it_through_the_bridge(server, tmp_path):
    """The server checks tokens: the browser's token goes on (and a wrong one comes back as 401),
    --server-token stands in for a browser that has none, and a token over its quota is 429."""
    async def one(url: str, headers: dict[str, str]) -> tuple[int, dict, dict]:
        async with aiohttp.ClientSession() as http:
            peer = BridgePeer(url)
            try:
                result = await offer(peer, http, headers)
                if result[0] == 200:
                    await peer.wait_for("session.created")
                return result
            finally:
                await peer.close()

    with rtmedia_web(server["target"], tmp_path / "plain.log") as (url, _):
        status, body, headers = asyncio.run(one(url, {}))
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", body  # the server's refusal
        assert asyncio.run(one(url, bearer(WRONG)))[0] == 401
        assert asyncio.run(one(url, bearer(ALICE)))[0] == 200  # passed on, accepted
    with rtmedia_web(server["target"], tmp_path / "server-token.log", "--server-token", BOB) as (url, _):
        assert asyncio.run(one(url, {}))[0] == 200
    with rtmedia_web(server["target"], tmp_path / "quota.log", "--auth-tokens", str(server["tokens"])) as (url, _):
        assert asyncio.run(one(url, bearer(QUOTA)))[0] == 200
        status, body, headers = asyncio.run(one(url, bearer(QUOTA)))  # sessions_per_minute=1
        assert status == 429 and body["reason"] == "quota" and int(headers["Retry-After"]) >= 1, (body, headers)


def test_the_bridge_beside_the_server_checks_its_tokens(server):
    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/healthz") as res:
                assert res.status == 200
                assert (await res.json())["target"].startswith("unix:")  # the server's private socket
            peer = BridgePeer(url)
            try:
                status, body, _ = await offer(peer, http, {})
                assert status == 401, body
            finally:
                await peer.close()
            peer = BridgePeer(url)
            try:
                status, body, _ = await offer(peer, http, bearer(BOB))
                assert status == 200, body
                await peer.wait_for("session.created")
                async with http.get(f"{url}/peers/{peer.peer_id}", headers=bearer(BOB)) as res:
                    assert (await res.json())["token_name"] == "bob"
            finally:
                await peer.close()

    asyncio.run(check(server["web"]))
