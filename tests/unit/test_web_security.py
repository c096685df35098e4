"""The bridge against hostile clients, in process: peer ids are capabilities, every bad
request gets a 4xx with a JSON error (no 500, no traceback) while other peers carry on, an
offer that could never connect is refused before it takes a slot, a request aiohttp cannot
parse costs the log one warning per peer at most, and a peer's media sockets bind only the
address the operator gave.

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

import aiohttp
import pytest
from aiortc import RTCPeerConnection
from rtmedia.web import bridge as bridge_module
from rtmedia.web.bridge import Bridge, BridgeConfig, OfferError, validate_offer
from rtmedia.web.cli import add_web_parser, bridge_config
from rtmedia.web.webrtc import ice_binding as ice_module
from rtmedia.web.webrtc.peer import Peer

from tests.support.waits import until
from tests.support.webrtc import BridgePeer, hostile_requests, repeat_audio


async def started(config: BridgeConfig) -> Bridge:
    bridge = Bridge(config)
    await bridge.start()
    return bridge


async def offer_sdp(video: bool = True, data: bool = True, audio: bool = True) -> str:
    pc = RTCPeerConnection()
    try:
        if audio:
            pc.addTransceiver("audio")
        if video:
            pc.addTransceiver("video", direction="recvonly")
        if data:
            pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        return pc.localDescription.sdp
    finally:
        await pc.close()


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


# What names an exception class: a refusal speaks of the offer, never of the code that read it.
EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b|StopIteration")


def unusable_offers(sdp: str) -> list[tuple[str, str, str]]:
    """Offers made from a good one (`sdp`: audio, video, data channel) that parse but could never
    carry a call, or hold a line aiortc cannot read: (name, offer, what the refusal must name)."""
    return [
        ("fingerprints in an unknown algorithm", re.sub(r"a=fingerprint:[\w-]+", "a=fingerprint:sha-999", sdp),
         "sha-999"),
        ("audio rejected", re.sub(r"m=audio \d+", "m=audio 0", sdp), "m=audio 0"),
        ("audio inactive", sdp.replace("a=sendrecv", "a=inactive", 1), "inactive"),
        ("audio receive-only", sdp.replace("a=sendrecv", "a=recvonly", 1), "recvonly"),
        ("an unreadable a=setup", sdp.replace("a=setup:actpass", "a=setup:sideways"), "a=setup:sideways"),
        ("an unreadable m= line", re.sub(r"m=audio \d+", "m=audio x", sdp), "m=audio x"),
        ("an unreadable a=rtpmap", sdp.replace("a=rtpmap:96 opus/48000/2", "a=rtpmap:96 opus"), "a=rtpmap:96 opus"),
    ]


def offer_requests(sdp: str) -> list[tuple[str, dict]]:
    """The offer as each door takes it: the page's JSON, WHIP's SDP, and OpenAI's Realtime calls' SDP."""
    as_sdp = {"data": sdp, "headers": {"Content-Type": "application/sdp"}}
    return [("/offer", {"json": {"sdp": sdp, "type": "offer"}}), ("/whip", as_sdp), ("/v1/realtime/calls", as_sdp)]


async def test_offers_that_could_never_connect_are_refused_at_once(sessionless, caplog):
    """Every door that takes an offer refuses one that could never carry a call with 400 at once,
    naming the problem in its API's error shape, and such an offer holds no slot: with room for
    one peer, a good offer is still answered after them all."""
    caplog.set_level(logging.INFO)
    bridge = await started(BridgeConfig(port=0, max_peers=1))
    url = f"http://127.0.0.1:{bridge.port}"
    sdp = await offer_sdp()
    cases = [*unusable_offers(sdp), ("no audio section", await offer_sdp(audio=False), "no audio section")]
    good = BridgePeer(url)
    try:
        async with aiohttp.ClientSession() as http:
            for name, offer, word in cases:
                for path, request in offer_requests(offer):
                    async with http.post(url + path, **request) as res:
                        body = await res.json()
                    assert res.status == 400, (name, path, res.status, body)
                    if path.startswith("/v1/"):
                        assert body["error"]["code"] == "invalid_offer", (name, body)
                        message = body["error"]["message"]
                    else:
                        message = body["error"]
                    assert word.lower() in message.lower(), (name, path, message)
                    assert not EXCEPTION_NAME.search(message), (name, path, message)
            assert not bridge.peers
            await good.connect(http)
            await good.wait_for("bridge.peer")
    finally:
        await good.close()
        await bridge.stop()
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not failures, [r.getMessage() for r in failures]


async def test_offer_checks_keep_what_can_connect():
    """A bundled section with port 0 (a=bundle-only, RFC 8843) is in use, and one fingerprint in an
    algorithm aiortc checks is enough beside others it does not know; an unreadable line is named
    by its number and text whatever the parser raised for it."""
    sdp = await offer_sdp()
    rejected = re.sub(r"m=audio \d+", "m=audio 0", sdp)
    with pytest.raises(OfferError, match="rejected"):
        validate_offer(rejected)
    validate_offer(rejected.replace("a=mid:0\r\n", "a=mid:0\r\na=bundle-only\r\n"))
    validate_offer(sdp.replace("a=fingerprint:sha-384", "a=fingerprint:sha-999"))
    lines = sdp.splitlines()
    setup = next(i for i, line in enumerate(lines) if line.startswith("a=setup:")) + 1
    with pytest.raises(OfferError, match=f"line {setup} cannot be read: 'a=setup:sideways'"):
        validate_offer(sdp.replace("a=setup:actpass", "a=setup:sideways"))


def test_limits_are_settings():
    config = BridgeConfig()
    assert config.max_body_bytes == 64 * 1024 and config.max_media_sections == 4
    # The connect deadline: short, so that peers that never connect cannot fill the bridge for long.
    assert config.connect_timeout_s == 10.0
    with pytest.raises(ValueError, match="connect_timeout_s"):
        BridgeConfig(connect_timeout_s=0)
    with pytest.raises(ValueError, match="max_body_bytes"):
        BridgeConfig(max_body_bytes=10)
    with pytest.raises(ValueError, match="max_media_sections"):
        BridgeConfig(max_media_sections=0)
    assert Bridge(BridgeConfig(max_body_bytes=4096)).app()._client_max_size == 4096
    # `rtmedia web`'s flags carry the same defaults, and reach the config.
    parser = argparse.ArgumentParser()
    add_web_parser(parser.add_subparsers())
    defaults = bridge_config(parser.parse_args(["web"]))
    assert (defaults.max_body_bytes, defaults.max_media_sections, defaults.media_host,
            defaults.connect_timeout_s) == (65536, 4, None, 10.0)
    given = bridge_config(parser.parse_args(["web", "--max-body-bytes", "8192", "--max-media-sections", "3",
                                             "--media-host", "0.0.0.0", "--connect-timeout", "25"]))
    assert (given.max_body_bytes, given.max_media_sections, given.media_bind_host,
            given.connect_timeout_s) == (8192, 3, "0.0.0.0", 25.0)


async def raw_request(port: int, data: bytes, source: str) -> bytes:
    """`data` sent on a fresh connection from address `source` (any of 127.0.0.0/8): the status
    line of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_requests_aiohttp_cannot_parse_get_400_and_a_warning_per_peer(caplog):
    """A request line or a header over aiohttp's limit, or a malformed header, never reaches the
    app: each gets aiohttp's 400, and the log gets one warning line without a traceback per
    peer address however many come, not an ERROR with the parser's traceback each time."""
    caplog.set_level(logging.INFO)
    bridge = await started(BridgeConfig(port=0))
    unparsable = [b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                  b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"b" * 9000 + b"\r\n\r\n",
                  b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n"]
    try:
        for source in ("127.0.0.1", "127.0.0.2"):
            for data in unparsable * 3:
                status = await raw_request(bridge.port, data, source)
                assert re.match(rb"HTTP/1\.[01] 400 ", status), (data[:40], status)
        status = await raw_request(bridge.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "127.0.0.1")
        assert status.startswith(b"HTTP/1.1 200 "), status
    finally:
        await bridge.stop()
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not failures, [r.getMessage() for r in failures]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(r.peer for r in warnings) == ["127.0.0.1", "127.0.0.2"], [r.getMessage() for r in warnings]
    assert all(r.getMessage() == "unparsable HTTP request" and r.kind == "LineTooLong" for r in warnings)


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
            await until(lambda: served.pc.connectionState == "connected", timeout=15, what="the peer connected")
            await peer.wait_for("bridge.peer")
        # Nothing else is narrowed: a peer connection outside the bridge gathers as aioice does.
        assert "127.0.0.1" not in ice_socket_addresses(peer.pc)
    finally:
        await peer.close()
        await bridge.stop()


async def test_media_host_setting_and_wildcards():
    binding = await ice_module.ice_binding("127.0.0.1")
    assert binding.addresses == ("127.0.0.1",)
    assert (await ice_module.ice_binding("localhost")).addresses is not None
    assert "127.0.0.1" in (await ice_module.ice_binding("localhost")).addresses
    assert (await ice_module.ice_binding("::")).addresses is None
    v4_only = await ice_module.ice_binding("0.0.0.0")
    assert v4_only.addresses is None and not v4_only.ipv6
    ice_module.install_ice_binding(asyncio.get_running_loop())
    token = ice_module.ICE_BINDING.set(v4_only)
    try:
        assert all(":" not in a for a in ice_module.aioice_ice.get_host_addresses(True, True))
    finally:
        ice_module.ICE_BINDING.reset(token)
    # --media-host overrides --host for the media sockets only.
    config = BridgeConfig(host="127.0.0.1", media_host="0.0.0.0")
    assert config.media_bind_host == "0.0.0.0"
    assert BridgeConfig(host="127.0.0.1").media_bind_host == "127.0.0.1"


async def test_mdns_socket_binds_the_group_on_the_bindings_address_only():
    """Resolving a browser's `.local` candidate under a --media-host binding: aioice's mDNS
    socket is bound to the group address (not 0.0.0.0), joined on that address, and works."""
    ice_module.install_ice_binding(asyncio.get_running_loop())
    token = ice_module.ICE_BINDING.set(await ice_module.ice_binding("127.0.0.1"))
    subscriber = object()
    try:
        protocol = await ice_module.aioice_ice.get_or_create_mdns_protocol(subscriber)
        sock = protocol.transport.get_extra_info("socket")
        assert sock.getsockname() == (ice_module.aioice_mdns.MDNS_ADDRESS, ice_module.aioice_mdns.MDNS_PORT)
        await protocol.publish("rtmedia-test.local", "127.0.0.1")  # answered by itself, over loopback
        assert await protocol.resolve("rtmedia-test.local", timeout=2) == "127.0.0.1"
    finally:
        await ice_module.aioice_ice.unref_mdns_protocol(subscriber)
        ice_module.ICE_BINDING.reset(token)


async def test_turn_tcp_connection_leaves_from_the_bindings_address():
    """aioice's TURN/TCP connection under a binding starts from the bound address (127.0.0.2:
    the kernel would pick 127.0.0.1 to reach 127.0.0.1)."""
    loop = asyncio.get_running_loop()
    ice_module.install_ice_binding(loop)
    accepted: list = []

    async def on_client(reader, writer):
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    token = ice_module.ICE_BINDING.set(await ice_module.ice_binding("127.0.0.2"))
    try:
        from aioice.turn import create_turn_endpoint

        with contextlib.suppress(Exception):  # this server closes at once: no allocation
            await asyncio.wait_for(create_turn_endpoint(asyncio.DatagramProtocol, ("127.0.0.1", port), "u", "p",
                                                        transport="tcp"), 1)
        assert accepted and accepted[0][0] == "127.0.0.2"
    finally:
        ice_module.ICE_BINDING.reset(token)
        server.close()
        await server.wait_closed()
