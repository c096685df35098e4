"""The bridge between real processes against a hostile client on the web port: it cannot
hang up anyone else's call, its bad requests get a 4xx with a JSON error and leave no
traceback in the log while a real call carries on, and `rtmedia web --host 127.0.0.1`
binds its media sockets on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import secrets
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.support.serve import RTMEDIA, free_port
from tests.support.webrtc import BridgePeer, hostile_requests, serve_with_web, wait_http

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_with_web(tmp_path_factory.mktemp("hostile"), "--web-max-peers", "4") as info:
        yield info


async def test_a_hostile_client_cannot_hurt_a_call(served):
    url = served["url"]
    async with aiohttp.ClientSession() as http:
        victim = BridgePeer(url)
        try:
            await victim.connect(http)
            await victim.wait_for("session.created")
            await victim.wait_for("bridge.peer")

            # The attacker learns no id, and without one ends nothing.
            async with http.get(f"{url}/healthz") as res:
                text = await res.text()
            assert victim.peer_id not in text and json.loads(text)["peers"] == 1, text
            for path in (f"/peers/{secrets.token_urlsafe(32)}", f"/whip/{victim.peer_id[:8]}"):
                async with http.delete(url + path) as res:
                    assert res.status == 404 and "error" in await res.json()

            # Every bad request: a 4xx naming the problem, in JSON.
            sdp = await victim_like_offer()
            for name, path, body, content_type, status, word in hostile_requests(sdp):
                async with http.post(url + path, data=body, headers={"Content-Type": content_type}) as res:
                    text = await res.text()
                    assert res.status == status and res.content_type == "application/json", (name, res.status, text)
                    assert word.lower() in json.loads(text)["error"].lower(), (name, text)

            # The call carries on: the session still answers, the peer is still connected.
            victim.send({"type": "session.update", "event_id": "after", "session": {"instructions": "still here"}})
            await victim.wait_for("session.updated", count=2)
            assert victim.pc.connectionState == "connected"
            async with http.get(f"{url}/peers/{victim.peer_id}") as res:
                assert res.status == 200 and (await res.json())["connection_state"] == "connected"
            # Its own id ends it.
            async with http.delete(f"{url}/peers/{victim.peer_id}") as res:
                assert res.status == 200
        finally:
            await victim.close()
    log = server_log(served)
    assert "Traceback" not in log and "Error handling request" not in log, log[-4000:]
    assert "offer refused" in log  # the refusals are logged, one line each


def server_log(served) -> str:
    return Path(served["log"]).read_text(errors="replace")


async def victim_like_offer() -> str:
    """An offer like the page's (audio, video, data channel), from a peer that goes away."""
    peer = BridgePeer("http://unused", video=True)
    try:
        return await peer.offer_sdp()
    finally:
        await peer.close()


def udp_sockets_of(pid: int) -> list[str]:
    """Local addresses of the UDP sockets process `pid` holds (its fds against /proc/net/udp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table, width in (("udp", 8), ("udp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                raw = bytes.fromhex(fields[1].split(":")[0])
                assert len(raw) * 2 == width
                # The kernel prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                addresses.append(str(ipaddress.ip_address(words)))
    return addresses


def test_rtmedia_web_binds_media_on_its_host_only(served):
    port = free_port()
    process = subprocess.Popen([RTMEDIA, "web", "--target", served["target"], "--host", "127.0.0.1",
                                "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    async def call() -> tuple[list[str], list[str]]:
        async with aiohttp.ClientSession() as http:
            peer = BridgePeer(url, video=True)
            try:
                await peer.connect(http)
                await peer.wait_for("session.created")
                await peer.wait_for("bridge.peer")  # connected: media flows through those sockets
                candidates = [line.split()[4] for line in peer.pc.remoteDescription.sdp.splitlines()
                              if line.startswith("a=candidate:")]
                return candidates, udp_sockets_of(process.pid)
            finally:
                await peer.close()

    try:
        wait_http(f"{url}/healthz", process)
        candidates, sockets = asyncio.run(call())
    finally:
        process.terminate()
        process.wait(15)
    assert candidates and set(candidates) == {"127.0.0.1"}, candidates
    assert sockets and set(sockets) == {"127.0.0.1"}, sockets
