"""The bridge against hostile clients, in process: peer ids are capabilities, every bad
request gets a 4xx with a JSON error (no 500, no traceback) while other peers carry on,
and a peer's media sockets bind only the address the operator gave.

The rtmedia server is not needed: `Peer.open_session` is replaced by one that opens no
Converse stream, so these tests exercise the HTTP front, aiortc and aioice only."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import re
import secrets
import time

import aiohttp
import pytest
from aiortc import RTCPeerConnection
from rtmedia.web import bridge as bridge_module
from rtmedia.web.bridge import Bridge, BridgeConfig, OfferError, validate_offer
from rtmedia.web.cli import add_web_parser, bridge_config
from rtmedia.web.peer import Peer

from tests.support.webrtc import BridgePeer, hostile_requests, repeat_audio


async def started(config: BridgeConfig) -> Bridge:
    bridge = Bridge(config)
    await bridge.start()
    return bridge


async def offer_sdp(video: bool = True, data: bool = True) -> str:
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("audio")
        if video:
            pc.addTransceiver("video", direction="recvonly")
        if data:
            pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        return pc.localDescription.sdp
    finally:
        await pc.close()


async def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def id_bits(peer_id: str) -> int:
    assert re.fullmatch(r"[A-Za-z0-9_-]+", peer_id), peer_id
    return len(base64.urlsafe_b64decode(peer_id + "=" * (-len(peer_id) % 4))) * 8


# ---- 1. peer ids are capabilities -----------------------------------------------------------------

async def test_peer_ids_are_unguessable_unlisted_and_needed_to_hang_up(sessionless):
    bridge = await started(BridgeConfig(port=0))
    url = f"http://127.0.0.1:{bridge.port}"
    alice, bob = BridgePeer(url), BridgePeer(url)
    try:
        async with aiohttp.ClientSession() as http:
            await alice.connect(http)
            await bob.connect(http)
            sdp = await offer_sdp()
            async with http.post(f"{url}/whip", data=sdp, headers={"Content-Type": "application/sdp"}) as res:
                assert res.status == 201
                whip_location = res.headers["Location"]
            whip_id = whip_location.rsplit("/", 1)[1]
            ids = [alice.peer_id, bob.peer_id, whip_id]
            assert len(set(ids)) == 3 and all(id_bits(i) >= 128 for i in ids), ids

            # /healthz counts; it names no peer.
            async with http.get(f"{url}/healthz") as res:
                text = await res.text()
                health = json.loads(text)
            assert health["peers"] == 3, health
            assert not any(i in text for i in ids), text
            assert not any(p.id in text for p in bridge.peers.values())

            # Hanging up needs the peer's own id: a guess (or an id's prefix) ends nobody.
            for guess in (secrets.token_urlsafe(32), alice.peer_id[:-1], alice.peer_id[:8]):
                for path in (f"/peers/{guess}", f"/whip/{guess}"):
                    async with http.delete(url + path) as res:
                        assert res.status == 404 and "error" in await res.json()
            assert len(bridge.peers) == 3

            # A peer sees its own statistics with its id.
            async with http.get(f"{url}/peers/{bob.peer_id}") as res:
                assert res.status == 200
                mine = await res.json()
            assert mine["session_id"] == "test-session" and "playout" in mine and "id" not in mine
            async with http.get(f"{url}/peers/{secrets.token_urlsafe(32)}") as res:
                assert res.status == 404

            # The page's own flow: DELETE with the id from its answer ends it, and only it.
            async with http.delete(f"{url}/peers/{alice.peer_id}") as res:
                assert res.status == 200
            async with http.delete(url + whip_location) as res:
                assert res.status == 200
            assert list(bridge.peers) == [bob.peer_id]
            async with http.get(f"{url}/healthz") as res:
                assert (await res.json())["peers"] == 1
    finally:
        await alice.close()
        await bob.close()
        await bridge.stop()


# ---- 2. bad input: 4xx with a JSON error, never a 500 ---------------------------------------------

async def test_hostile_requests_get_4xx_json_and_spare_other_peers(sessionless, caplog):
    caplog.set_level(logging.INFO)
    bridge = await started(BridgeConfig(port=0))
    url = f"http://127.0.0.1:{bridge.port}"
    bystander = BridgePeer(url)
    try:
        async with aiohttp.ClientSession() as http:
            await bystander.connect(http)
            await bystander.wait_for("bridge.peer")
            sdp = await offer_sdp()
            for name, path, body, content_type, status, word in hostile_requests(sdp):
                async with http.post(url + path, data=body, headers={"Content-Type": content_type}) as res:
                    text = await res.text()
                    assert res.status == status, (name, res.status, text)
                    assert res.content_type == "application/json", (name, text)
                    error = json.loads(text)["error"]
                    assert word.lower() in error.lower(), (name, error)
            # Routes and methods the bridge does not have answer in the same shape.
            async with http.get(f"{url}/no-such-page") as res:
                assert res.status == 404 and "error" in await res.json()
            async with http.patch(f"{url}/whip/anything", data="") as res:
                assert res.status == 405 and "trickle" in (await res.json())["error"]
            async with http.put(f"{url}/offer", data="") as res:
                assert res.status == 405 and "error" in await res.json()

            # Nothing failed inside the bridge, and the bystander is still there, connected.
            failures = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
            assert not failures, [r.getMessage() for r in failures]
            assert list(bridge.peers) == [bystander.peer_id] and bystander.pc.connectionState == "connected"
            assert bridge.peers[bystander.peer_id].pc.connectionState == "connected"
            # ... and a good offer is still answered.
            late = BridgePeer(url, video=True)
            try:
                await late.connect(http)
                await late.wait_for("bridge.peer")
            finally:
                await late.close()
    finally:
        await bystander.close()
        await bridge.stop()


async def test_offer_validation_bounds_sections_and_names_structure_problems():
    sdp = await offer_sdp()
    assert [m.kind for m in validate_offer(sdp).media] == ["audio", "video", "application"]
    with pytest.raises(OfferError, match="at most 2"):
        validate_offer(sdp, max_media=2)
    with pytest.raises(OfferError, match="mid 0"):
        validate_offer(repeat_audio(sdp, 3, fresh_mids=False), max_media=64)
    assert len(validate_offer(repeat_audio(sdp, 3, fresh_mids=True), max_media=64).media) == 6
    with pytest.raises(OfferError, match="bytes") as info:
        validate_offer(sdp, max_bytes=1000)
    assert info.value.status == 413
    # Audio-only offers (WHIP clients) and offers without BUNDLE stay fine.
    validate_offer(await offer_sdp(video=False, data=False))
    validate_offer(re.sub(r"a=group:BUNDLE [^\r\n]*\r\n", "", sdp))


def test_limits_are_settings():
    config = BridgeConfig()
    assert config.max_body_bytes == 64 * 1024 and config.max_media_sections == 4
    with pytest.raises(ValueError, match="max_body_bytes"):
        BridgeConfig(max_body_bytes=10)
    with pytest.raises(ValueError, match="max_media_sections"):
        BridgeConfig(max_media_sections=0)
    assert Bridge(BridgeConfig(max_body_bytes=4096)).app()._client_max_size == 4096
    # `rtmedia web`'s flags carry the same defaults, and reach the config.
    parser = argparse.ArgumentParser()
    add_web_parser(parser.add_subparsers())
    defaults = bridge_config(parser.parse_args(["web"]))
    assert (defaults.max_body_bytes, defaults.max_media_sections, defaults.media_host) == (65536, 4, None)
    given = bridge_config(parser.parse_args(["web", "--max-body-bytes", "8192", "--max-media-sections", "3",
                                             "--media-host", "0.0.0.0"]))
    assert (given.max_body_bytes, given.max_media_sections, given.media_bind_host) == (8192, 3, "0.0.0.0")


async def test_page_events_nested_too_deeply_are_refused():
    """The data channel's JSON gets the same treatment: an error event back, no exception."""
    pc = RTCPeerConnection()
    peer = Peer(secrets.token_urlsafe(32), pc, None, 16000, bridge_module.VideoDefaults(), lambda p: None)
    sent: list[str] = []

    class Channel:
        readyState = "open"
        send = staticmethod(sent.append)

    peer._channel = Channel()
    try:
        peer._on_page_message("[" * 100000 + "]" * 100000)
        peer._on_page_message('{"type": "session.update", "session": ' + '{"a": ' * 100000 + "1" + "}" * 100001)
        errors = [json.loads(s) for s in sent]
        assert [(e["type"], e["code"]) for e in errors] == [("bridge.error", "invalid_event")] * 2, errors
        assert all("nested" in e["message"] for e in errors), errors
    finally:
        await pc.close()


# ---- 3. media sockets bind only where the operator said -----------------------------------------

def ice_socket_addresses(pc: RTCPeerConnection) -> set[str]:
    """The local addresses of every UDP socket of a peer connection's ICE transports."""
    transports = {t.receiver.transport for t in pc.getTransceivers()}
    if pc.sctp is not None:
        transports.add(pc.sctp.transport)
    addresses = set()
    for dtls in transports:
        connection = dtls.transport.iceGatherer._connection
        for protocol in connection._protocols:
            addresses.add(protocol.transport.get_extra_info("sockname")[0])
    return addresses


async def test_media_sockets_bind_only_the_host(sessionless):
    bridge = await started(BridgeConfig(port=0, host="127.0.0.1"))
    url = f"http://127.0.0.1:{bridge.port}"
    peer = BridgePeer(url, video=True)
    try:
        async with aiohttp.ClientSession() as http:
            await peer.connect(http)
            served = bridge.peers[peer.peer_id]
            assert ice_socket_addresses(served.pc) == {"127.0.0.1"}
            candidates = [line.split()[4] for line in peer.pc.remoteDescription.sdp.splitlines()
                          if line.startswith("a=candidate:")]
            assert candidates and set(candidates) == {"127.0.0.1"}, candidates
            # It still connects: over loopback, to a client that gathers every address.
            await wait_until(lambda: served.pc.connectionState == "connected")
            await peer.wait_for("bridge.peer")
        # Nothing else is narrowed: a peer connection outside the bridge gathers as aioice does.
        assert "127.0.0.1" not in ice_socket_addresses(peer.pc)
    finally:
        await peer.close()
        await bridge.stop()


async def test_media_host_setting_and_wildcards():
    binding = await bridge_module.ice_binding("127.0.0.1")
    assert binding.addresses == ("127.0.0.1",)
    assert (await bridge_module.ice_binding("localhost")).addresses is not None
    assert "127.0.0.1" in (await bridge_module.ice_binding("localhost")).addresses
    assert (await bridge_module.ice_binding("::")).addresses is None
    v4_only = await bridge_module.ice_binding("0.0.0.0")
    assert v4_only.addresses is None and not v4_only.ipv6
    bridge_module.install_ice_binding(asyncio.get_running_loop())
    token = bridge_module._ICE_BINDING.set(v4_only)
    try:
        assert all(":" not in a for a in bridge_module.aioice_ice.get_host_addresses(True, True))
    finally:
        bridge_module._ICE_BINDING.reset(token)
    # --media-host overrides --host for the media sockets only.
    config = BridgeConfig(host="127.0.0.1", media_host="0.0.0.0")
    assert config.media_bind_host == "0.0.0.0"
    assert BridgeConfig(host="127.0.0.1").media_bind_host == "127.0.0.1"


async def test_mdns_socket_binds_the_group_on_the_bindings_address_only():
    """Resolving a browser's `.local` candidate under a --media-host binding: aioice's mDNS
    socket is bound to the group address (not 0.0.0.0), joined on that address, and works."""
    bridge_module.install_ice_binding(asyncio.get_running_loop())
    token = bridge_module._ICE_BINDING.set(await bridge_module.ice_binding("127.0.0.1"))
    subscriber = object()
    try:
        protocol = await bridge_module.aioice_ice.get_or_create_mdns_protocol(subscriber)
        sock = protocol.transport.get_extra_info("socket")
        assert sock.getsockname() == (bridge_module.aioice_mdns.MDNS_ADDRESS, bridge_module.aioice_mdns.MDNS_PORT)
        await protocol.publish("rtmedia-test.local", "127.0.0.1")  # answered by itself, over loopback
        assert await protocol.resolve("rtmedia-test.local", timeout=2) == "127.0.0.1"
    finally:
        await bridge_module.aioice_ice.unref_mdns_protocol(subscriber)
        bridge_module._ICE_BINDING.reset(token)


async def test_turn_tcp_connection_leaves_from_the_bindings_address():
    """aioice's TURN/TCP connection under a binding starts from the bound address (127.0.0.2:
    the kernel would pick 127.0.0.1 to reach 127.0.0.1)."""
    loop = asyncio.get_running_loop()
    bridge_module.install_ice_binding(loop)
    accepted: list = []

    async def on_client(reader, writer):
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    token = bridge_module._ICE_BINDING.set(await bridge_module.ice_binding("127.0.0.2"))
    try:
        from aioice.turn import create_turn_endpoint

        with contextlib.suppress(Exception):  # this server closes at once: no allocation
            await asyncio.wait_for(create_turn_endpoint(asyncio.DatagramProtocol, ("127.0.0.1", port), "u", "p",
                                                        transport="tcp"), 1)
        assert accepted and accepted[0][0] == "127.0.0.2"
    finally:
        bridge_module._ICE_BINDING.reset(token)
        server.close()
        await server.wait_closed()
