"""The WebRTC bridge: an aiohttp app that serves the page and turns browser peer
connections into Converse sessions on an rtmedia server (a gRPC client like any other).

Signalling, non-trickle (the answer carries every ICE candidate):

- `POST /offer` with JSON `{"sdp": "...", "type": "offer"}` -> `{"sdp", "type": "answer", "id"}`,
  as aiortc's own examples do; `DELETE /peers/{id}` ends the peer.
- `POST /whip` with an `application/sdp` offer -> `201 Created`, the answer, and
  `Location: /whip/{id}`; `DELETE /whip/{id}` ends it (RFC 9725). Deviation: WHIP
  ingests media only, while these transceivers are send-receive (the reply audio, and
  video when the offer has a video section, come back on the same connection).
  `PATCH` (trickle ICE) answers 405.

Bad input gets a 4xx naming the problem; a full bridge (`max_peers`) answers 503 and
says so; a server that refuses the session answers 502/503 with its gRPC status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription, rtcsctptransport
from aiortc.sdp import SessionDescription
from rtmedia.clients.client import CHANNEL_OPTIONS
from rtmedia.web.peer import OfferError, Peer, VideoDefaults
from rtmedia.web.tracks import set_audio_prefetch

log = logging.getLogger("rtmedia.web")

STATIC = Path(__file__).with_name("static")
MAX_SDP_BYTES = 64 * 1024
# Small-MTU paths (IPv6 minimum 1280, VPN tunnels): aiortc fragments data-channel
# messages into DATA chunks of this much user data at most. 1100 bytes keeps a full
# SCTP packet, with DTLS, UDP and IPv6 headers, well under 1280 bytes; oversized
# datagrams are dropped on such paths and aiortc has no path-MTU discovery, so an
# ordered channel would stall for good. (aiortc >= 1.14 already caps it at 1160.)
SCTP_MAX_USER_DATA = 1100


def cap_sctp_chunk_size(limit: int = SCTP_MAX_USER_DATA) -> int:
    """Lower aiortc's SCTP DATA chunk size to `limit` bytes (never raise it); returns the size in force."""
    rtcsctptransport.USERDATA_MAX_LENGTH = min(rtcsctptransport.USERDATA_MAX_LENGTH, limit)
    return rtcsctptransport.USERDATA_MAX_LENGTH


@dataclass
class BridgeConfig:
    target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8080
    tls_cert: str | None = None
    tls_key: str | None = None
    ice_servers: list[str] = field(default_factory=list)
    udp_ports: tuple[int, int] | None = None
    max_peers: int = 8
    input_rate: int = 16000  # the session's input rate: the microphone is resampled to it
    # Microphone frames held before decoding: 0 decodes each packet as it arrives (a late
    # packet is dropped), N adds N x 20 ms (aiortc's own 4: 80 ms). Raise it on paths with
    # much jitter or reordering.
    audio_prefetch: int = 0
    connect_timeout_s: float = 30.0  # an answered peer must connect within this
    session: dict[str, Any] = field(default_factory=dict)  # session.update fields every session starts with
    video: VideoDefaults = field(default_factory=VideoDefaults)

    def __post_init__(self) -> None:
        if not 0 <= self.audio_prefetch <= 16:
            raise ValueError(f"audio_prefetch must be 0..16 frames, got {self.audio_prefetch}")
        if self.max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {self.max_peers}")
        if self.input_rate not in (8000, 16000, 24000):
            raise ValueError(f"input_rate must be 8000, 16000 or 24000, got {self.input_rate}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a TLS certificate needs its key and a key its certificate (--tls-cert and --tls-key)")
        if self.udp_ports is not None:
            lo, hi = self.udp_ports
            if not 1 <= lo <= hi <= 65535:
                raise ValueError(f"udp_ports must be a range A-B with 1 <= A <= B <= 65535, got {lo}-{hi}")
        for url in self.ice_servers:
            if not url.startswith(("stun:", "turn:", "turns:")):
                raise ValueError(f"ICE server {url!r} must be a stun:, turn: or turns: URL")


def parse_udp_ports(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"--udp-ports must look like 40000-40100, got {text!r}") from None
    return lo, hi


def ice_server(url: str) -> RTCIceServer:
    """`turn:user:pass@host:port` carries its credentials in the URL; others are plain."""
    scheme, _, rest = url.partition(":")
    if scheme.startswith("turn") and "@" in rest:
        creds, _, host = rest.rpartition("@")
        username, _, password = creds.partition(":")
        return RTCIceServer(urls=f"{scheme}:{host}", username=username, credential=password)
    return RTCIceServer(urls=url)


def validate_offer(sdp: Any) -> SessionDescription:
    """The parsed offer, or OfferError(400) naming what is wrong with it."""
    if not isinstance(sdp, str) or not sdp.strip():
        raise OfferError(400, "the offer has no SDP")
    if len(sdp) > MAX_SDP_BYTES:
        raise OfferError(413, f"the SDP offer is {len(sdp)} bytes; at most {MAX_SDP_BYTES} are accepted")
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError(400, "malformed SDP offer: it must start with 'v=0'")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # the parser raises whatever the bad line provokes
        raise OfferError(400, f"malformed SDP offer: {type(exc).__name__}: {exc}") from None
    audio = [m for m in parsed.media if m.kind == "audio"]
    if not audio:
        raise OfferError(400, "the SDP offer has no audio section: the bridge needs the microphone (m=audio)")
    if not any((m.direction or "sendrecv") in ("sendrecv", "sendonly") for m in audio):
        raise OfferError(400, "the SDP offer's audio is receive-only: the bridge needs the browser to send "
                              "its microphone (a=sendrecv or a=sendonly)")
    for m in parsed.media:
        if m.kind in ("audio", "video") and m.port != 0 and not (m.ice.usernameFragment and m.dtls
                                                                   and m.dtls.fingerprints):
            raise OfferError(400, f"the SDP offer's {m.kind} section lacks ICE credentials or a DTLS fingerprint")
    return parsed


class Bridge:
    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        self.peers: dict[str, Peer] = {}
        self._opening = 0  # offers being answered (they count against max_peers)
        self.refused = 0
        self.channel: grpc.aio.Channel | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""
        self.sctp_chunk = cap_sctp_chunk_size()

    # ---- the app --------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_SDP_BYTES * 2)
        app.router.add_get("/", self.index)
        app.router.add_static("/static/", STATIC)
        app.router.add_get("/healthz", self.health)
        app.router.add_get("/config", self.page_config)
        app.router.add_post("/offer", self.offer)
        app.router.add_delete("/peers/{peer_id}", self.delete)
        app.router.add_post("/whip", self.whip)
        app.router.add_options("/whip", self.whip_options)
        app.router.add_delete("/whip/{peer_id}", self.delete)
        app.router.add_patch("/whip/{peer_id}", self.whip_patch)
        return app

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        if self.config.udp_ports:
            install_udp_port_range(loop, self.config.udp_ports)
        self.channel = grpc.aio.insecure_channel(self.config.target, options=CHANNEL_OPTIONS)
        ssl_context = None
        if self.config.tls_cert:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://{self.config.host}:{self.port}/"
        log.info("web bridge listening", extra={"url": self.url, "target": self.config.target,
                                                "max_peers": self.config.max_peers, "sctp_chunk": self.sctp_chunk})
        return self.port

    async def stop(self) -> None:
        await asyncio.gather(*(peer.close("bridge shutting down") for peer in list(self.peers.values())),
                             return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.channel is not None:
            await self.channel.close()

    # ---- handlers ---------------------------------------------------------------------------------------
    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"target": self.config.target, "max_peers": self.config.max_peers,
                                  "refused": self.refused, "peers": [p.describe() for p in self.peers.values()]})

    async def page_config(self, request: web.Request) -> web.Response:
        """What the page needs before it offers: the ICE servers (as RTCIceServer dictionaries)."""
        servers = []
        for url in self.config.ice_servers:
            server = ice_server(url)
            entry: dict[str, Any] = {"urls": server.urls}
            if server.username:
                entry.update(username=server.username, credential=server.credential)
            servers.append(entry)
        return web.json_response({"ice_servers": servers, "input_sample_rate": self.config.input_rate})

    async def offer(self, request: web.Request) -> web.Response:
        try:
            if request.content_type != "application/json":
                raise OfferError(415, f"POST /offer takes application/json, not {request.content_type or 'nothing'}"
                                      " (use POST /whip for application/sdp)")
            try:
                body = await request.json()
            except ValueError as exc:
                raise OfferError(400, f"the body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise OfferError(400, "the body must be a JSON object with 'sdp' and 'type'")
            if body.get("type") != "offer":
                raise OfferError(400, f"'type' must be \"offer\", got {body.get('type')!r}")
            peer, answer = await self.answer(body.get("sdp"))
        except OfferError as exc:
            return web.json_response({"error": exc.message}, status=exc.status)
        return web.json_response({"sdp": answer, "type": "answer", "id": peer.id})

    async def whip(self, request: web.Request) -> web.Response:
        try:
            if request.content_type != "application/sdp":
                raise OfferError(415, f"POST /whip takes application/sdp, not {request.content_type or 'nothing'}")
            peer, answer = await self.answer(await request.text())
        except OfferError as exc:
            return web.Response(status=exc.status, text=exc.message + "\n")
        return web.Response(status=201, text=answer, content_type="application/sdp",
                            headers={"Location": f"/whip/{peer.id}", "ETag": f'"{peer.id}"'})

    async def whip_options(self, request: web.Request) -> web.Response:
        return web.Response(status=204, headers={"Accept-Post": "application/sdp"})

    async def whip_patch(self, request: web.Request) -> web.Response:
        return web.Response(status=405, headers={"Allow": "DELETE"},
                            text="trickle ICE is not supported: the answer already carries every candidate\n")

    async def delete(self, request: web.Request) -> web.Response:
        peer = self.peers.get(request.match_info["peer_id"])
        if peer is None:
            return web.Response(status=404, text="no such peer (it may have closed already)\n")
        await peer.close("ended by the client")
        return web.Response(status=200, text="closed\n")

    # ---- peers ----------------------------------------------------------------------------------------------
    async def answer(self, sdp: Any) -> tuple[Peer, str]:
        """Validate the offer, open a session, answer; raises OfferError."""
        offer = validate_offer(sdp)
        if len(self.peers) + self._opening >= self.config.max_peers:
            self.refused += 1
            raise OfferError(503, f"the bridge is full: it serves at most {self.config.max_peers} peers at once "
                                  "(--max-peers); try again when one has ended")
        self._opening += 1
        try:
            return await self._answer(sdp, any(m.kind == "video" and m.port != 0 for m in offer.media))
        finally:
            self._opening -= 1

    async def _answer(self, sdp: str, video: bool) -> tuple[Peer, str]:
        servers = [ice_server(url) for url in self.config.ice_servers]
        pc = RTCPeerConnection(RTCConfiguration(iceServers=servers or None))
        peer_id = secrets.token_urlsafe(12)
        assert self.channel is not None, "start() the bridge first"
        peer = Peer(peer_id, pc, self.channel, self.config.input_rate, self.config.video, self._forget)
        try:
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            except (ValueError, TypeError, KeyError) as exc:
                raise OfferError(400, f"the SDP offer was not accepted: {exc}") from None
            peer.mic_buffers = set_audio_prefetch(pc, self.config.audio_prefetch)
            await peer.open_session(self.config.session)  # SessionRefused is an OfferError
            pc.addTrack(peer.audio_out)
            if video:
                pc.addTrack(peer.video_out)
            await pc.setLocalDescription(await pc.createAnswer())
        except BaseException:
            await peer.close("offer failed")
            raise
        self.peers[peer_id] = peer
        asyncio.get_running_loop().create_task(self._expect_connection(peer), name=f"peer-{peer_id}-connect")
        log.info("peer answered", extra={"peer": peer_id, "session_id": peer.session_id, "video": video})
        return peer, pc.localDescription.sdp

    async def _expect_connection(self, peer: Peer) -> None:
        """A peer that never connects (the browser went away) is closed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(peer.closed.wait(), self.config.connect_timeout_s)
            return
        if peer.pc.connectionState != "connected":
            await peer.close(f"not connected within {self.config.connect_timeout_s:g} s")

    def _forget(self, peer: Peer) -> None:
        self.peers.pop(peer.id, None)


def install_udp_port_range(loop: asyncio.AbstractEventLoop, ports: tuple[int, int]) -> None:
    """Bind ICE's UDP sockets (aioice asks for port 0) to a port in `ports` instead, for
    firewalls that open one range. Other datagram endpoints of the loop are untouched."""
    lo, hi = ports
    original = loop.create_datagram_endpoint

    async def create_datagram_endpoint(protocol_factory: Any, local_addr: Any = None, **kwargs: Any) -> Any:
        module = getattr(protocol_factory, "__module__", "") or ""
        if not (module.startswith("aioice") and local_addr and local_addr[1] == 0):
            return await original(protocol_factory, local_addr=local_addr, **kwargs)
        candidates = list(range(lo, hi + 1))
        random.shuffle(candidates)
        for port in candidates:
            with contextlib.suppress(OSError):
                return await original(protocol_factory, local_addr=(local_addr[0], port), **kwargs)
        raise OSError(f"no free UDP port in {lo}-{hi} on {local_addr[0]} (--udp-ports)")

    loop.create_datagram_endpoint = create_datagram_endpoint  # type: ignore[method-assign]


async def start_beside(server_config: Any, grpc_port: int) -> Bridge:
    """`rtmedia serve --web`: the bridge on the server's host, bridging to its gRPC port."""
    host = server_config.host
    target_host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    target = f"[{target_host}]:{grpc_port}" if ":" in target_host else f"{target_host}:{grpc_port}"
    bridge = Bridge(BridgeConfig(target=target, host=host, port=server_config.web_port,
                                 tls_cert=server_config.web_tls_cert, tls_key=server_config.web_tls_key,
                                 max_peers=server_config.web_max_peers))
    await bridge.start()
    return bridge
