"""Twilio Media Streams on the web port (docs/telephony.md): a phone call reaches rtmedia through
Twilio, one `Converse` session per call.

- `POST /twilio/voice` is the number's voice webhook: it answers TwiML that connects the call's
  audio to `wss://…/twilio/media` (bidirectional), passing the caller and the called number as
  stream parameters.
- `GET /twilio/media` is that WebSocket. Twilio sends `connected`, `start` (the call's
  `streamSid`, `mediaFormat` audio/x-mulaw at 8000 Hz, `customParameters`), `media` (base64
  μ-law of the caller, 20 ms a message), `mark` (a mark it was sent, once the audio before it has
  played), `dtmf` (a key the caller pressed: `input_audio_buffer.dtmf`, which the session
  answers with `input_audio_buffer.dtmf_event_received`) and `stop`. The door answers with
  `media` (the reply as μ-law), a `mark` after each reply delta named `RESPONSE_ID:END_MS`, and
  `clear` at a barge-in. Each mark Twilio returns becomes `playback.ack` of that much of the
  reply, so the server truncates an interrupted reply at what the caller heard.

Twilio cannot send bearer tokens: both routes are authenticated by `X-Twilio-Signature`
(HMAC-SHA1 of the URL Twilio called, and a form POST's parameters sorted by name, with the
account's auth token), and refused (403) when no auth token is configured unless the operator
opted out (`insecure`). The URL is the one Twilio used: `public_url` when the door sits behind a
proxy that rewrites it.

A socket that sends something other than Twilio's JSON messages, a `media` before `start`, or no
`start` within `start_timeout_s` is closed (1003 or 1008) with the reason; the server refusing the
session closes it with 1011 or 1013 (over capacity). Other calls are unaffected.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from xml.sax.saxutils import quoteattr

from aiohttp import WSCloseCode, WSMsgType, web
from rtmedia.clients.errors import RtmediaError
from rtmedia.protocol.events import client_event
from rtmedia.protocol.turn_kinds import SERVER_VAD
from rtmedia.v1 import realtime_pb2
from rtmedia.web.audio_encode import G711Encoder
from rtmedia.web.door import STOP, Door, Fault, fault_of, on
from rtmedia.web.http_errors import error_response

log = logging.getLogger(__name__)
TRANSPORT = "twilio"
RATE = 8000
TOKEN_ENV = "RTMEDIA_TWILIO_AUTH_TOKEN"
# customParameters of the <Stream> that choose the session's config (others are kept as metadata).
SESSION_PARAMETERS = ("responder", "voice", "instructions")
MAX_PARAMETER_CHARS = 2000
TRY_AGAIN_LATER = 1013  # WebSocket close code: the server is at capacity


@dataclass(frozen=True)
class TwilioConfig:
    """`auth_token`: the account's auth token, which signs Twilio's requests (None: unsigned
    requests are refused unless `insecure`); `public_url`: the door's base URL as Twilio calls
    it (https://host[:port], default: the request's own); `start_timeout_s`: how long a socket
    may go without Twilio's `start`."""

    auth_token: str | None = None
    insecure: bool = False
    public_url: str | None = None
    start_timeout_s: float = 10.0

    @classmethod
    def load(cls, token_file: str | None, insecure: bool = False, public_url: str | None = None) -> TwilioConfig:
        """The auth token from `token_file`, else $RTMEDIA_TWILIO_AUTH_TOKEN; a missing or empty
        file is a ValueError naming it."""
        token = os.environ.get(TOKEN_ENV) or None
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"--twilio-auth-token-file {token_file}: {exc.strerror or exc}") from None
            if not token:
                raise ValueError(f"--twilio-auth-token-file {token_file}: the file is empty")
        if public_url is not None:
            parts = urlsplit(public_url)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
                raise ValueError(f"--twilio-public-url must be http(s)://HOST[:PORT][/PATH], got {public_url!r}")
        return cls(token, insecure, public_url.rstrip("/") if public_url else None)


def signature(auth_token: str, url: str, params: dict[str, str] | None = None) -> str:
    """Twilio's request signature: base64 HMAC-SHA1 of the URL followed by each POST parameter's
    name and value, sorted by name."""
    data = url + "".join(f"{k}{v}" for k, v in sorted((params or {}).items()))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode()


class TwilioDoor:
    """The two routes, on the web front's app (rtmedia.web.bridge)."""

    def __init__(self, config: TwilioConfig, upstream: Any) -> None:
        self.config, self.upstream = config, upstream
        self.calls = 0  # sockets with a session

    def add_routes(self, app: web.Application) -> set[Any]:
        """Adds the routes; the resources that bearer tokens do not guard (signatures do)."""
        return {app.router.add_post("/twilio/voice", self.voice).resource,
                app.router.add_get("/twilio/media", self.media).resource}

    # ---- authentication ---------------------------------------------------------------------------
    def url_of(self, request: web.Request, socket: bool = False) -> str:
        """The URL Twilio requested: under `public_url` if set, else as the request says (behind
        a proxy, X-Forwarded-Proto and X-Forwarded-Host); `socket`: as ws:// or wss://."""
        if self.config.public_url:
            proto, host = self.config.public_url.split("://", 1)
        else:
            proto = request.headers.get("X-Forwarded-Proto", request.scheme).split(",")[0].strip()
            host = request.headers.get("X-Forwarded-Host", request.host).split(",")[0].strip()
        if socket:
            proto = "wss" if proto == "https" else "ws"
        return f"{proto}://{host}{request.path_qs}"

    def refused(self, request: web.Request, url: str, params: dict[str, str] | None = None) -> web.Response | None:
        """The 403 for a request that is not Twilio's; None for one that is."""
        if self.config.auth_token is None:
            if self.config.insecure:
                return None
            why = ("the Twilio door has no auth token to check X-Twilio-Signature with: set "
                   f"--twilio-auth-token-file or ${TOKEN_ENV} (or opt out with --twilio-insecure)")
        elif not (given := request.headers.get("X-Twilio-Signature", "")):
            why = "X-Twilio-Signature is missing: only Twilio may call this route"
        elif not hmac.compare_digest(given, signature(self.config.auth_token, url, params)):
            why = ("X-Twilio-Signature does not match this URL and these parameters (a proxy that rewrites the URL "
                   "needs --twilio-public-url)")
        else:
            return None
        log.info("twilio request refused", extra={"path": request.path, "url": url, "why": why})
        return error_response(403, why, reason="twilio_signature")

    # ---- the voice webhook -------------------------------------------------------------------------
    def draining(self) -> web.Response | None:
        """The 503 while the web front drains: new calls go to another replica."""
        if not self.upstream.draining():
            return None
        return error_response(503, "the server is shutting down (draining): call another replica",
                              {"Retry-After": "5"}, "draining")

    async def voice(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        if (refusal := self.refused(request, self.url_of(request), form) or self.draining()) is not None:
            return refusal
        media = urlsplit(self.url_of(request, socket=True))
        stream_url = f"{media.scheme}://{media.netloc}{media.path.rsplit('/', 1)[0]}/media"
        parameters = "".join(f"<Parameter name={quoteattr(k)} value={quoteattr(form[k][:MAX_PARAMETER_CHARS])}/>"
                             for k in ("From", "To", "CallSid") if form.get(k))
        twiml = ('<?xml version="1.0" encoding="UTF-8"?><Response><Connect>'
                 f"<Stream url={quoteattr(stream_url)}>{parameters}</Stream></Connect></Response>")
        return web.Response(text=twiml, content_type="text/xml")

    # ---- the media stream ---------------------------------------------------------------------------
    async def media(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=20.0, compress=False, max_msg_size=1 << 20)
        if not ws.can_prepare(request).ok:
            raise web.HTTPBadRequest(text="/twilio/media is a WebSocket (Twilio's Media Streams)\n")
        if (refusal := self.refused(request, self.url_of(request, socket=True))
                or self.draining()) is not None:
            return refusal
        await ws.prepare(request)
        call = TwilioCall(self, request, ws)
        try:
            await call.run()
        finally:
            if call.session is not None:
                call.session.cancel_stream()
            if not ws.closed:
                await ws.close(code=call.close_code, message=call.close_reason[:120].encode())
        return ws


class TwilioCall(Door):
    """One Media Streams socket and its Converse session: Twilio's messages are the door's
    requests (`requests`), and the reply's audio, its marks and a barge-in's `clear` its answers."""

    transport = TRANSPORT

    def __init__(self, door: TwilioDoor, request: web.Request, ws: web.WebSocketResponse) -> None:
        super().__init__()
        self.door, self.request, self.ws = door, request, ws
        self.stream_sid = ""
        self.encoder = G711Encoder("pcm_mulaw")
        self.sent: dict[str, int] = {}  # reply samples sent to Twilio, per response
        self.close_code: int = WSCloseCode.OK
        self.close_reason = ""

    def refuse(self, code: int, reason: str) -> None:
        self.close_code, self.close_reason = code, reason
        log.info("twilio stream closed", extra={"reason": reason, "stream_sid": self.stream_sid})

    async def run(self) -> None:
        start = await self._start()
        if start is None:
            return
        try:
            await self._open(start)
        except RtmediaError as exc:
            fault = fault_of(exc)
            if not fault.busy:  # the door's own set-up (e.g. no --server-token for a server with tokens)
                log.warning("twilio call refused by the server", extra={"code": exc.code.name, "details": exc.details})
            self.refuse(TRY_AGAIN_LATER if fault.busy else WSCloseCode.INTERNAL_ERROR,
                        f"the rtmedia server refused the call: {exc.code.name}: {exc.details}")
            return
        self.door.calls += 1
        try:
            await self.converse()
        finally:
            self.door.calls -= 1

    async def _message(self) -> dict[str, Any] | None:
        """Twilio's next message; None when the socket ended or sent something else (closed)."""
        msg = await self.ws.receive()
        if msg.type != WSMsgType.TEXT:
            if msg.type == WSMsgType.BINARY:
                self.refuse(WSCloseCode.UNSUPPORTED_DATA, "binary frames are not Twilio messages")
            return None
        try:
            event = json.loads(msg.data)
        except (ValueError, RecursionError):
            self.refuse(WSCloseCode.UNSUPPORTED_DATA, "a message that is not JSON")
            return None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            self.refuse(WSCloseCode.UNSUPPORTED_DATA, "a message without an event name")
            return None
        return event

    async def _start(self) -> dict[str, Any] | None:
        """Twilio's `start` (after `connected`), within start_timeout_s; None: closed why."""
        try:
            async with asyncio.timeout(self.door.config.start_timeout_s):
                while (event := await self._message()) is not None:
                    if event["event"] == "start":
                        return self._checked_start(event)
                    if event["event"] != "connected":
                        self.refuse(WSCloseCode.POLICY_VIOLATION, f"{event['event'][:40]!r} before start")
                        return None
        except TimeoutError:
            self.refuse(WSCloseCode.POLICY_VIOLATION,
                        f"no start message within {self.door.config.start_timeout_s:g} s")
        return None

    def _checked_start(self, event: dict[str, Any]) -> dict[str, Any] | None:
        start = event.get("start")
        fmt = start.get("mediaFormat") if isinstance(start, dict) else None
        if not isinstance(fmt, dict) or not isinstance(start.get("streamSid") or event.get("streamSid"), str):
            self.refuse(WSCloseCode.POLICY_VIOLATION, "start without streamSid and mediaFormat")
            return None
        if fmt.get("encoding") != "audio/x-mulaw" or fmt.get("sampleRate") != RATE or fmt.get("channels", 1) != 1:
            self.refuse(WSCloseCode.POLICY_VIOLATION, f"mediaFormat {json.dumps(fmt)[:80]}: only audio/x-mulaw "
                                                      f"at {RATE} Hz, mono")
            return None
        self.stream_sid = start.get("streamSid") or event["streamSid"]
        return start

    async def _open(self, start: dict[str, Any]) -> None:
        params = start.get("customParameters") if isinstance(start.get("customParameters"), dict) else {}
        config: dict[str, Any] = {
            "input_audio_format": {"encoding": "g711_ulaw", "sample_rate": RATE},
            "output_sample_rate": RATE, "input_audio_transcription": {"enabled": True},
            "turn_detection": {"type": SERVER_VAD}}
        for key in SESSION_PARAMETERS:
            if isinstance(params.get(key), str) and params[key]:
                config[key] = params[key][:MAX_PARAMETER_CHARS]
        await self.open_converse(self.door.upstream.channel(), self.door.upstream.metadata(self.request))
        assert self.session is not None
        await self.session.send(client_event("session.update", session=config))
        log.info("twilio call", extra={"stream_sid": self.stream_sid, "call_sid": str(start.get("callSid", ""))[:64],
                                       "from": str(params.get("From", ""))[:64], "to": str(params.get("To", ""))[:64]})

    # ---- Twilio -> the session ----
    async def requests(self) -> AsyncIterator[realtime_pb2.ConverseRequest]:
        while (event := await self._message()) is not None:
            kind = event["event"]
            if kind == "media":
                media = event.get("media")
                if not isinstance(media, dict) or media.get("track", "inbound") != "inbound":
                    continue  # (an outbound track echoed back is not the caller)
                try:
                    audio = base64.b64decode(media.get("payload", ""), validate=True)
                except (binascii.Error, TypeError, ValueError):
                    self.refuse(WSCloseCode.UNSUPPORTED_DATA, "media payload is not base64")
                    return
                yield client_event("input_audio_buffer.append", audio=audio)
            elif kind == "mark":
                name = str((event.get("mark") or {}).get("name", ""))
                response_id, _, end_ms = name.rpartition(":")
                if response_id and end_ms.isdigit():  # played up to there
                    yield client_event("playback.ack", response_id=response_id, played_ms=int(end_ms))
            elif kind == "stop":
                return
            elif kind == "dtmf":
                digit = str((event.get("dtmf") or {}).get("digit", ""))  # (the server refuses a bad one)
                yield client_event("input_audio_buffer.dtmf", event=digit)

    # ---- the session -> Twilio ----
    async def _send(self, message: dict[str, Any]) -> None:
        await asyncio.wait_for(self.ws.send_str(json.dumps(message, separators=(",", ":"))), 10.0)

    @on("response.output_audio.delta")
    async def _audio(self, msg: realtime_pb2.ConverseResponse) -> None:
        delta = msg.response_output_audio_delta
        if not delta.audio:
            return
        payload = self.encoder.encode(delta.audio)
        samples = self.sent[delta.response_id] = self.sent.get(delta.response_id, 0) + len(delta.audio) // 2
        end = samples * 1000 // RATE
        await self._send({"event": "media", "streamSid": self.stream_sid,
                          "media": {"payload": base64.b64encode(payload).decode()}})
        await self._send({"event": "mark", "streamSid": self.stream_sid,
                          "mark": {"name": f"{delta.response_id}:{end}"}})

    @on("output_audio_buffer.cleared")
    async def _cleared(self, msg: realtime_pb2.ConverseResponse) -> None:
        await self._send({"event": "clear", "streamSid": self.stream_sid})  # barge-in: drop what Twilio holds

    @on("session.closed")
    def _closed(self, msg: realtime_pb2.ConverseResponse) -> bool:
        return STOP

    @on("error")
    def _error(self, msg: realtime_pb2.ConverseResponse) -> None:
        log.warning("twilio call: session error", extra={"stream_sid": self.stream_sid, "code": msg.error.code,
                                                         "error_message": msg.error.message[:200]})

    async def on_fault(self, fault: Fault) -> None:
        if not fault.quiet:
            self.refuse(WSCloseCode.INTERNAL_ERROR, f"the rtmedia session failed: {fault.details}"[:120])
