"""The WebRTC bridge: an aiohttp app that serves the page and turns browser peer
connections into Converse sessions on an rtmedia server (a gRPC client like any other).

Signalling, non-trickle (the answer carries every ICE candidate):

- `POST /offer` with JSON `{"sdp": "...", "type": "offer"}` -> `{"sdp", "type": "answer", "id"}`,
  as aiortc's own examples do; `DELETE /peers/{id}` ends the peer, `GET /peers/{id}` its statistics.
- `POST /whip` with an `application/sdp` offer -> `201 Created`, the answer, and
  `Location: /whip/{id}`; `DELETE /whip/{id}` ends it (RFC 9725). Deviation: WHIP
  ingests media only, while these transceivers are send-receive (the reply audio, and
  video when the offer has a video section, come back on the same connection).
  `PATCH` (trickle ICE) answers 405.

A peer id is the peer's capability: 256 random bits (`secrets.token_urlsafe`), given only
to the client whose offer created it (the answer, `Location`, the page's `bridge.peer`
event); `/healthz` counts peers and names none, and only the id ends or shows a peer.
Logs and task names carry a short prefix of it (`Peer.tag`).

Bad input gets a 4xx with a JSON body `{"error": "..."}` naming the problem (every error
answer has that shape, aiohttp's own 404/405/413 included: rtmedia.web.http_errors, which also
keeps requests aiohttp cannot parse from flooding the log); the request body is bounded
(`max_body_bytes`, aiohttp's `client_max_size`) and so are an offer's media sections
(`max_media_sections`). An offer is checked before anything is spent on it
(rtmedia.web.webrtc.offers): one that could never connect is refused with 400 at once. A full bridge
(`max_peers`) answers 503 and says so; a server that refuses the session answers 401, 429, 502
or 503 with its gRPC status (below). An answered peer holds its slot and its session only until
the connect deadline (`connect_timeout_s`) unless its connection is up by then.

ICE binds only where the operator said (`media_host`, default the page's `host`): see
rtmedia.web.webrtc.ice_binding.

Tokens (`auth_tokens`, rtmedia.protocol.tokens): while the table has tokens, the `authenticate`
middleware wants `Authorization: Bearer TOKEN` on every route but the page (`GET /`,
`/static/*`) and `GET /healthz`; a WebSocket handshake may offer the subprotocol
`rtmedia.bearer.TOKEN` instead (browsers cannot set headers on one). Anything else gets 401
with `WWW-Authenticate: Bearer` and says no more. The token's NAME goes to the peer's log lines
and statistics, never the token.

Toward the server: TLS (`server_tls`, `server_ca`), a client certificate (`server_cert`,
`server_key`), and per call `authorization: Bearer TOKEN` metadata: the token the browser
presented, else `server_token`. In plaintext a token goes only to a loopback or unix-socket
target. The server's refusals become HTTP: UNAUTHENTICATED 401, QUOTA 429 with Retry-After,
MAX_SESSIONS, AT_CAPACITY and DRAINING 503.

`reload()` (SIGHUP) re-reads the page's TLS certificate into the live SSL context and swaps the
token table; `drain(grace_s)` (SIGTERM) refuses new offers with 503 while the peers live on
until their sessions end or the grace runs out, then stops.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import secrets
import ssl
import time
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription, rtcsctptransport
from rtmedia.protocol.tokens import (
    OPENAI_KEY_PROTOCOL_PREFIX,
    WEBSOCKET_PROTOCOL_PREFIX,
    TokenTable,
    bearer,
)
from rtmedia.web.app_keys import BEARER_KEY, SECRET_KEY, TOKEN_KEY, WS_PROTOCOL_KEY
from rtmedia.web.bridge_config import BridgeConfig, is_local_target, is_metadata_value, parse_udp_ports
from rtmedia.web.http_errors import ServerLog, error_response, json_errors, refusal
from rtmedia.web.openai.openai_api import OpenAIConfig, OpenAIFront, Upstream, openai_errors
from rtmedia.web.openai.realtime_events import Translator
from rtmedia.web.server_channel import server_channel, server_credentials, trace_context
from rtmedia.web.settings import TwilioSettings, WebSettings
from rtmedia.web.telephony.sip_api import SipCallsApi
from rtmedia.web.telephony.twilio import TwilioConfig, TwilioDoor
from rtmedia.web.webrtc.ice_binding import IceBinding, binding_in_force, ice_binding, install_ice_binding
from rtmedia.web.webrtc.offers import (
    NEGOTIATION_ERRORS,
    negotiation_failure,
    validate_offer,
)
from rtmedia.web.webrtc.peer import OfferError, Peer, VideoDefaults
from rtmedia.web.webrtc.tracks import PLAYOUT_RATE, set_audio_prefetch

# Re-exported: the bridge's settings and helpers are importable from here as before.
__all__ = [
    "BEARER_KEY", "TOKEN_KEY", "WS_PROTOCOL_KEY", "Bridge", "BridgeConfig", "OfferError", "VideoDefaults",
    "cap_sctp_chunk_size", "ice_server", "is_local_target", "parse_udp_ports", "server_credentials",
    "start_beside", "validate_offer",
]

log = logging.getLogger("rtmedia.web")

STATIC = Path(__file__).with_name("static")
PEER_ID_BYTES = 32  # secrets.token_urlsafe: 256 bits, 43 characters
# Small-MTU paths (IPv6 minimum 1280, VPN tunnels): aiortc fragments data-channel
# messages into DATA chunks of this much user data at most. 1100 bytes keeps a full
# SCTP packet, with DTLS, UDP and IPv6 headers, well under 1280 bytes; oversized
# datagrams are dropped on such paths and aiortc has no path-MTU discovery, so an
# ordered channel would stall for good. (aiortc >= 1.14 already caps it at 1160.)
SCTP_MAX_USER_DATA = 1100
DRAIN_RETRY_AFTER_S = 5  # Retry-After of an offer refused while draining: another replica, or this one restarted
AUTH_MESSAGE = "authentication required: send Authorization: Bearer TOKEN"


def cap_sctp_chunk_size(limit: int = SCTP_MAX_USER_DATA) -> int:
    """Lower aiortc's SCTP DATA chunk size to `limit` bytes (never raise it); returns the size in force."""
    rtcsctptransport.USERDATA_MAX_LENGTH = min(rtcsctptransport.USERDATA_MAX_LENGTH, limit)
    return rtcsctptransport.USERDATA_MAX_LENGTH


def ice_server(url: str) -> RTCIceServer:
    """`turn:user:pass@host:port` carries its credentials in the URL; others are plain."""
    scheme, _, rest = url.partition(":")
    if scheme.startswith("turn") and "@" in rest:
        creds, _, host = rest.rpartition("@")
        username, _, password = creds.partition(":")
        return RTCIceServer(urls=f"{scheme}:{host}", username=username, credential=password)
    return RTCIceServer(urls=url)


class Bridge:
    def __init__(self, config: BridgeConfig, tokens: TokenTable | None = None) -> None:
        """`tokens`: the web port's token table (shared with the server beside it); None: read
        `config.auth_tokens`, or none (authentication off)."""
        self.config = config
        if tokens is None:
            tokens = TokenTable.load(config.auth_tokens) if config.auth_tokens else TokenTable()
        self.tokens = tokens
        self.ssl_context: ssl.SSLContext | None = None
        self.draining = False
        self.stopped = asyncio.Event()  # set once stop() has finished
        self._stopping = False
        self._open_resources: set[Any] = set()  # filled by app()
        self.peers: dict[str, Peer] = {}
        self._opening = 0  # offers being answered (they count against max_peers)
        self.refused = 0
        self.channel: grpc.aio.Channel | None = None  # what new peers call the server on
        self._retired: list[grpc.aio.Channel] = []  # replaced by a reload; closed once no peer uses them
        self._closing_channels: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""
        self.sctp_chunk = cap_sctp_chunk_size()
        self.ice = IceBinding(ports=config.udp_ports)  # resolved from media_bind_host in start()
        self.openai: OpenAIFront | None = None  # made by app() when config.openai says so
        self.twilio: TwilioDoor | None = None  # made by app() when config.twilio says so
        self._signed_resources: set[Any] = set()  # Twilio's: checked by signature, not bearer tokens

    # ---- the app --------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[json_errors, openai_errors, self.authenticate])
        # Open without a token: the page (so a user can give one) and the probes' /healthz.
        self._open_resources = {
            app.router.add_get("/", self.index).resource,
            app.router.add_get("/static/{name:.*}", self.static).resource,
            app.router.add_get("/healthz", self.health).resource,
        }
        app.router.add_get("/config", self.page_config)
        app.router.add_post("/offer", self.offer)
        app.router.add_get("/peers/{peer_id}", self.peer_stats)
        app.router.add_delete("/peers/{peer_id}", self.delete)
        app.router.add_post("/whip", self.whip)
        app.router.add_options("/whip", self.whip_options)
        app.router.add_delete("/whip/{peer_id}", self.delete)
        app.router.add_patch("/whip/{peer_id}", self.whip_patch)
        upstream = Upstream(self._channel, self.server_metadata, lambda: self.draining, calls=self)
        if self.config.openai is not None:
            self.openai = OpenAIFront(upstream, self.config.openai)
            self.openai.add_routes(app)
        if self.config.twilio is not None:
            self.twilio = TwilioDoor(self.config.twilio, upstream)
            self._signed_resources = self.twilio.add_routes(app)
        if self.config.sip_calls is not None:
            SipCallsApi(self.config.sip_calls).add_routes(app)
        return app

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self.ice = await ice_binding(self.config.media_bind_host, self.config.udp_ports)
        install_ice_binding(loop)
        self.channel = server_channel(self.config.target, server_credentials(self.config))
        ssl_context = None
        if self.config.tls_cert:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        self.ssl_context = ssl_context
        # logger: a request aiohttp cannot parse is a rate-limited warning, not an ERROR with a traceback.
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, logger=ServerLog())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://{self.config.host}:{self.port}/"
        log.info("web bridge listening", extra={"url": self.url, "target": self.config.target,
                                                "max_peers": self.config.max_peers, "sctp_chunk": self.sctp_chunk,
                                                "media_addresses": ",".join(self.ice.addresses or ("*",)),
                                                "auth": self.tokens.enabled,
                                                "server_tls": self.config.server_tls})
        if not self.config.forwards_tokens:
            log.warning("tokens the browsers present are not forwarded to the server: it is not on this machine "
                        "and the channel has no TLS (--server-tls)", extra={"target": self.config.target})
        return self.port

    async def stop(self) -> None:
        """Close every peer and the listener now; idempotent."""
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        try:
            await asyncio.gather(*(peer.close("bridge shutting down") for peer in list(self.peers.values())),
                                 return_exceptions=True)
            if self._runner is not None:
                await self._runner.cleanup()
            for channel in [*self._retired, *([self.channel] if self.channel else [])]:
                await channel.close()
            self._retired.clear()
        finally:
            self.stopped.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new offers from now on (503, Retry-After, reason `draining`); let the live peers
        go on until their sessions end (a draining server closes each one after the turn in
        flight with session.closed{server_shutdown}) or `grace_s` has passed; then stop."""
        if not self.draining:
            self.draining = True
            log.info("web bridge draining", extra={"peers": len(self.peers), "grace_s": grace_s})
        deadline = time.monotonic() + max(0.0, grace_s)
        while (self.peers or self._opening or (self.openai and (self.openai.active or self.openai.sockets))
               or (self.twilio and self.twilio.calls)) and (left := deadline - time.monotonic()) > 0:
            # Offers already being answered become peers (or fail); every peer is waited for.
            closing = [asyncio.ensure_future(p.closed.wait()) for p in list(self.peers.values())]
            try:
                if closing:
                    await asyncio.wait(closing, timeout=min(0.25, left), return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(min(0.05, left))
            finally:
                for waiter in closing:
                    waiter.cancel()
        if self.peers:
            log.info("drain grace over: closing the remaining peers", extra={"peers": len(self.peers)})
        await asyncio.shield(self.stop())  # a cancelled drain still stops whole (stop() waits for it)

    def reload(self, tokens: TokenTable | None = None) -> None:
        """SIGHUP: re-read the page's TLS certificate and key into the live SSL context (new
        handshakes get the new certificate; live peers are untouched), and swap the token table:
        to `tokens` (the server's, beside it), else this one re-read from its file. With
        --server-tls, re-read the CA, certificate and key toward the server: new peers dial on a
        new channel, live peers keep theirs until they close. A file that does not load leaves
        the old in force and is named in one log line."""
        self._reload_server_credentials()
        if self.ssl_context is not None and self.config.tls_cert:
            cert, key = self.config.tls_cert, self.config.tls_key
            try:
                # Into a scratch context first: a failed load_cert_chain may leave a context half changed.
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
                self.ssl_context.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as exc:
                log.warning(f"reload: the TLS certificate {cert} (key {key}) did not load; the old one stays: "
                            f"{getattr(exc, 'strerror', None) or exc}")
            else:
                log.info("reload: TLS certificate re-read", extra={"cert": cert})
        try:
            table = tokens if tokens is not None else self.tokens.reloaded()
        except ValueError as exc:  # names the file and line, never a token
            log.warning(f"reload: the token file did not load; the old tokens stay: {exc}")
            return
        self.tokens = table
        log.info("reload: tokens in force", extra={"tokens": len(table.tokens), "auth": table.enabled})

    # ---- handlers ---------------------------------------------------------------------------------------
    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def static(self, request: web.Request) -> web.StreamResponse:
        """A file of the page's (`/static/NAME`). One that is not there is a 404 in the bridge's
        JSON shape: aiohttp's own static route would answer it with an empty body."""
        name = request.match_info["name"]
        path = await asyncio.to_thread(static_file, name)
        if path is None:
            return error_response(404, f"no such file: /static/{name[:100]}")
        return web.FileResponse(path)

    async def health(self, request: web.Request) -> web.Response:
        """Counts only: a peer id is its owner's capability, so none is listed here."""
        peers = list(self.peers.values())
        return web.json_response({"target": self.config.target, "max_peers": self.config.max_peers,
                                  "draining": self.draining,
                                  "peers": len(peers), "opening": self._opening, "refused": self.refused,
                                  "connected": sum(p.pc.connectionState == "connected" for p in peers),
                                  "late_mic_packets": sum(p.late_mic_packets for p in peers)})

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
            text = await self._body_text(request)
            try:
                body = json.loads(text)
            except RecursionError:
                raise OfferError(400, "the JSON body is nested too deeply") from None
            except ValueError as exc:
                raise OfferError(400, f"the body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise OfferError(400, "the body must be a JSON object with 'sdp' and 'type'")
            if body.get("type") != "offer":
                raise OfferError(400, f"'type' must be \"offer\", got {str(body.get('type'))[:32]!r}")
            peer, answer = await self.answer(body.get("sdp"), request)
        except OfferError as exc:
            return self._refuse(request, exc)
        return web.json_response({"sdp": answer, "type": "answer", "id": peer.id})

    async def whip(self, request: web.Request) -> web.Response:
        try:
            if request.content_type != "application/sdp":
                raise OfferError(415, f"POST /whip takes application/sdp, not {request.content_type or 'nothing'}")
            peer, answer = await self.answer(await self._body_text(request), request)
        except OfferError as exc:
            return self._refuse(request, exc)
        return web.Response(status=201, text=answer, content_type="application/sdp",
                            headers={"Location": f"/whip/{peer.id}", "ETag": f'"{peer.id}"'})

    async def whip_options(self, request: web.Request) -> web.Response:
        return web.Response(status=204, headers={"Accept-Post": "application/sdp"})

    async def whip_patch(self, request: web.Request) -> web.Response:
        return error_response(405, "trickle ICE is not supported: the answer already carries every candidate",
                              headers={"Allow": "DELETE"})

    def _own_peer(self, request: web.Request) -> Peer | None:
        return self.own_peer(request.match_info["peer_id"], request)

    def own_peer(self, peer_id: str, request: web.Request) -> Peer | None:
        """The peer of that id (the id is the credential); with tokens on, only for a request
        carrying the same token's name that made it: another token's holder who learnt an id
        sees no peer there."""
        peer = self.peers.get(peer_id)
        token = request.get(TOKEN_KEY)
        if peer is None or (token is not None and peer.token_name != token.name):
            return None
        return peer

    async def delete(self, request: web.Request) -> web.Response:
        """Ends the peer whose id is in the URL."""
        peer = self._own_peer(request)
        if peer is None:
            return error_response(404, "no such peer (it may have closed already)")
        await peer.close("ended by the client")
        return web.Response(status=200, text="closed\n")

    async def peer_stats(self, request: web.Request) -> web.Response:
        peer = self._own_peer(request)
        if peer is None:
            return error_response(404, "no such peer (it may have closed already)")
        return web.json_response(peer.describe())

    async def _body_text(self, request: web.Request) -> str:
        """The request body as text: bounded (max_body_bytes), UTF-8 (or ASCII) only; raises OfferError."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise OfferError(413, f"the request body is larger than {self.config.max_body_bytes} bytes "
                                  "(--max-body-bytes)") from None
        charset = request.charset or "utf-8"
        try:
            codec = codecs.lookup(charset).name
        except LookupError:
            codec = ""
        if codec not in ("utf-8", "ascii"):
            raise OfferError(415, f"charset {charset[:32]!r} is not supported: send UTF-8")
        try:
            return raw.decode(codec)
        except UnicodeDecodeError as exc:
            raise OfferError(400, f"the body is not valid {'ASCII' if codec == 'ascii' else 'UTF-8'}: "
                                  f"{exc.reason} at byte {exc.start}") from None

    def _refuse(self, request: web.Request, exc: OfferError) -> web.Response:
        token = request.get(TOKEN_KEY)
        log.info("offer refused", extra={"path": request.path, "status": exc.status, "error": exc.message[:300],
                                         **({"token_name": token.name} if token else {})})
        return error_response(exc.status, exc.message, exc.headers, exc.reason)

    # ---- authentication ---------------------------------------------------------------------------------
    @web.middleware
    async def authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """While the token table has tokens: `Authorization: Bearer TOKEN` (or, on a WebSocket
        handshake, the subprotocol `rtmedia.bearer.TOKEN`) on every route but the page's and
        /healthz, else 401. A presented token is kept on the request (BEARER_KEY) to be forwarded
        to the server, the matched token (TOKEN_KEY) for its name."""
        if request.match_info.route.resource in self._signed_resources:
            return await handler(request)  # Twilio's: its handler checks X-Twilio-Signature
        presented, protocol = presented_token(request)
        if self.openai is not None and request.path.startswith("/v1/realtime") and \
                (secret := self.openai.secrets.get(presented)) is not None:
            # A Realtime client secret: its calls act as the token that asked for it.
            request[SECRET_KEY] = presented  # type: ignore[assignment]
            if secret.token is not None:
                request[TOKEN_KEY] = secret.token
            if secret.bearer is not None:
                request[BEARER_KEY] = secret.bearer
            if protocol:
                request[WS_PROTOCOL_KEY] = protocol
            return await handler(request)
        tokens = self.tokens  # one table for the whole request, whatever a reload does meanwhile
        if tokens.enabled:
            token = tokens.match(presented)
            if token is None:
                if request.method in ("GET", "HEAD") and request.match_info.route.resource in self._open_resources:
                    return await handler(request)
                log.info("request refused: no valid token", extra={"method": request.method,
                                                                   "path": request.path[:200],
                                                                   "presented": presented is not None})
                return refusal(request, 401, AUTH_MESSAGE, {"WWW-Authenticate": "Bearer"}, "unauthenticated")
            request[TOKEN_KEY] = token
            if protocol:
                request[WS_PROTOCOL_KEY] = protocol
        if presented is not None and is_metadata_value(presented):
            request[BEARER_KEY] = presented
        return await handler(request)

    # ---- peers ----------------------------------------------------------------------------------------------
    async def answer(self, sdp: Any, request: web.Request | None = None, translator: Translator | None = None
                     ) -> tuple[Peer, str]:
        """Validate the offer, open a session, answer; raises OfferError. `request`: the offer's
        (its token goes on the session's calls, its token's name to the peer's logs); `translator`:
        a call of the Realtime API (rtmedia.web.openai.realtime_calls)."""
        if self.draining:
            self.refused += 1
            raise OfferError(503, "the bridge is shutting down (draining); connect again shortly",
                             {"Retry-After": str(DRAIN_RETRY_AFTER_S)}, "draining")
        offer = validate_offer(sdp, self.config.max_body_bytes, self.config.max_media_sections)
        if len(self.peers) + self._opening >= self.config.max_peers:
            self.refused += 1
            raise OfferError(503, f"the bridge is full: it serves at most {self.config.max_peers} peers at once "
                                  "(--max-peers); try again when one has ended")
        token = request.get(TOKEN_KEY) if request is not None else None
        metadata = self.server_metadata(request)
        if translator is not None:
            metadata = (*metadata, ("rtmedia-transport", "openai-webrtc"))
            translator.track_rates = (self.config.input_rate, PLAYOUT_RATE)
        else:
            metadata = (*metadata, ("rtmedia-transport", "webrtc"))
        self._opening += 1
        try:
            return await self._answer(sdp, any(m.kind == "video" and m.port != 0 for m in offer.media), metadata,
                                      token.name if token else None, translator)
        finally:
            self._opening -= 1

    def server_metadata(self, request: web.Request | None) -> tuple[tuple[str, str], ...]:
        """The metadata of a request's calls to the server: the token the client presented (where
        tokens may be forwarded), else `server_token`; and the request's W3C trace context, so the
        server's trace of the call continues the client's."""
        presented = request.get(BEARER_KEY) if request is not None else None
        secret = presented if presented and self.config.forwards_tokens else self.config.server_token
        return ((("authorization", f"Bearer {secret}"),) if secret else ()) + trace_context(request)

    def _channel(self) -> grpc.aio.Channel:
        assert self.channel is not None, "start() the bridge first"
        return self.channel

    async def _answer(self, sdp: str, video: bool, metadata: tuple[tuple[str, str], ...] = (),
                      token_name: str | None = None, translator: Translator | None = None) -> tuple[Peer, str]:
        servers = [ice_server(url) for url in self.config.ice_servers]
        # Every socket aioice opens for this peer (in this task and the tasks it starts) binds per self.ice.
        with binding_in_force(self.ice):
            pc = RTCPeerConnection(RTCConfiguration(iceServers=servers or None))
            peer_id = secrets.token_urlsafe(PEER_ID_BYTES)
            assert self.channel is not None, "start() the bridge first"
            peer = Peer(peer_id, pc, self.channel, self.config.input_rate, self.config.video, self._forget,
                        metadata, token_name, translator)
            try:
                try:
                    await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
                except NEGOTIATION_ERRORS as exc:
                    raise OfferError(400, f"the SDP offer was not accepted: {negotiation_failure(exc)}") from None
                peer.mic_buffers = set_audio_prefetch(pc, self.config.audio_prefetch)
                await peer.open_session(self.config.session)  # SessionRefused is an OfferError
                pc.addTrack(peer.audio_out)
                if video:
                    pc.addTrack(peer.video_out)
                try:
                    await pc.setLocalDescription(await pc.createAnswer())
                except NEGOTIATION_ERRORS as exc:
                    raise OfferError(400, f"the bridge cannot answer this SDP offer: {negotiation_failure(exc)}"
                                     ) from None
            except BaseException:
                await peer.close("offer failed")
                raise
        self.peers[peer_id] = peer
        # Its slot and its session are held only until the connect deadline unless it connects.
        peer.expect_connection(self.config.connect_timeout_s)
        log.info("peer answered", extra={**peer.log_fields, "session_id": peer.session_id, "video": video})
        return peer, pc.localDescription.sdp

    def _reload_server_credentials(self) -> None:
        if not self.config.server_tls or self.channel is None or self._stopping:
            return
        try:
            credentials = server_credentials(self.config)
        except ValueError as exc:  # read_pem names the flag and the file
            log.warning(f"reload: the credentials toward the server did not load; the old ones stay: {exc}")
            return
        self._retired.append(self.channel)
        self.channel = server_channel(self.config.target, credentials)
        log.info("reload: credentials toward the server re-read", extra={"target": self.config.target})
        self._close_unused_channels()

    def _close_unused_channels(self) -> None:
        """Close the channels a reload replaced once no live peer calls the server on them."""
        used = {id(peer.grpc_channel) for peer in self.peers.values()}
        for channel in [c for c in self._retired if id(c) not in used]:
            self._retired.remove(channel)
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing_channels.add(task)
            task.add_done_callback(self._closing_channels.discard)

    def _forget(self, peer: Peer) -> None:
        self.peers.pop(peer.id, None)
        if self._retired:
            self._close_unused_channels()


def static_file(name: str, root: Path = STATIC) -> Path | None:
    """The file `name` names under `root`, or None: missing, a directory, or outside `root`."""
    try:
        path = (root / name).resolve()
        return path if path.is_relative_to(root.resolve()) and path.is_file() else None
    except (OSError, ValueError):  # an embedded NUL, a name too long for the file system
        return None


def presented_token(request: web.Request) -> tuple[str | None, str | None]:
    """The token a request presents, and the WebSocket subprotocol that carried it (None when the
    Authorization header did): `Authorization: Bearer TOKEN`, else, on a WebSocket handshake,
    the first offered subprotocol `rtmedia.bearer.TOKEN` or, as OpenAI's browser clients send
    it, `openai-insecure-api-key.TOKEN`."""
    token = bearer(request.headers.get("Authorization"))
    if token is not None or request.headers.get("Upgrade", "").lower() != "websocket":
        return token, None
    for header in request.headers.getall("Sec-WebSocket-Protocol", ()):
        for protocol in (p.strip() for p in header.split(",")):
            for prefix in (WEBSOCKET_PROTOCOL_PREFIX, OPENAI_KEY_PROTOCOL_PREFIX):
                if protocol.startswith(prefix) and len(protocol) > len(prefix):
                    return protocol[len(prefix):], protocol
    return None, None


async def start_beside(web: WebSettings, twilio: TwilioSettings, host: str, target: str, tokens: TokenTable,
                       sip_calls: str | None = None) -> Bridge:
    """`rtmedia serve --web`: the bridge on the server's `host` (with the `web` and `twilio` sections
    of the server's configuration), bridging to `target` (the server's
    private plaintext address, e.g. `unix:/path`, that only this bridge dials) and checking the
    web port against `tokens`, the server's own table (the server calls `bridge.reload(tokens)`
    with the new one on SIGHUP, and `bridge.drain(grace_s)` on SIGTERM). The tokens browsers
    present go on to the server with their sessions. `sip_calls`: the SIP door's control URL
    (`serve --sip`), whose calls API the web port then serves."""
    bridge = Bridge(BridgeConfig(target=target, host=host, port=web.port, tls_cert=web.tls_cert, tls_key=web.tls_key,
                                 max_peers=web.max_peers, openai=OpenAIConfig() if web.openai_api else None,
                                 twilio=TwilioConfig.load(twilio.auth_token_file, twilio.insecure, twilio.public_url)
                                 if twilio.enabled else None, sip_calls=sip_calls), tokens)
    await bridge.start()
    return bridge
