"""OpenAI's Realtime API over WebRTC (docs/openai.md#realtime-over-webrtc): a call is a peer of the
bridge (rtmedia.web.webrtc.peer) whose `oai-events` data channel speaks the API's events.

- `POST /v1/realtime/calls`: an SDP offer, as `application/sdp` (OpenAI's browser example) or as
  multipart `sdp` + `session` JSON (the SDK's `realtime.calls.create`); answers 201 with the SDP
  answer and `Location: /v1/realtime/calls/{call_id}`.
- `POST /v1/realtime/calls/{call_id}/hangup`: ends the call.
- `POST /v1/realtime/client_secrets`: a short-lived key (`ek_...`) for a browser, valid for
  `expires_after.seconds` (10..7200, default 600) to open calls and sockets as the token that
  asked for it, with the session it was given as the new session's start.
- `GET /v1/realtime?call_id=...`: a control socket attached to a call (the application's server
  watching and steering a browser's call: `realtime.connect(call_id=...)`).

A call id is `rtc_` and the peer's id: the peer's capability, known to whoever made the call.
With tokens on, only the same token's holder reaches the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web
from rtmedia.protocol.tokens import Token
from rtmedia.web.app_keys import BEARER_KEY, SECRET_KEY, TOKEN_KEY
from rtmedia.web.openai.openai_errors import OpenAIError
from rtmedia.web.openai.realtime_config import RealtimeConfig, RealtimeError, new_config
from rtmedia.web.openai.realtime_events import Translator

CALL_PREFIX = "rtc_"
SECRET_PREFIX = "ek_"
SECRET_TTL_S = (10, 7200, 600)  # min, max, default of expires_after.seconds
MAX_SECRETS = 10_000  # live keys; a flood of requests cannot grow the table without bound
SIDEBAND_EVENTS = 1000  # events a control socket may be behind before it is let go


@dataclass(frozen=True)
class Secret:
    expires_at: float
    session: dict[str, Any] | None  # the session.update object a new session starts with
    token: Token | None  # the web token that asked for it
    bearer: str | None  # the secret that token presented, forwarded to the server for the key's sessions


class ClientSecrets:
    """Live short-lived keys."""

    def __init__(self) -> None:
        self._keys: dict[str, Secret] = {}

    def issue(self, seconds: int, session: dict[str, Any] | None, token: Token | None, bearer: str | None) -> tuple[str, Secret]:
        self._expire()
        if len(self._keys) >= MAX_SECRETS:
            raise OpenAIError(429, f"{MAX_SECRETS} client secrets are live; retry when some have expired",
                              "requests", code="rate_limit_exceeded", headers={"Retry-After": "10"})
        key = SECRET_PREFIX + secrets.token_urlsafe(24)
        secret = self._keys[key] = Secret(time.time() + seconds, session, token, bearer)
        return key, secret

    def get(self, key: str | None) -> Secret | None:
        secret = self._keys.get(key) if key else None
        if secret is not None and secret.expires_at <= time.time():
            del self._keys[key]  # type: ignore[arg-type]
            return None
        return secret

    def _expire(self) -> None:
        now = time.time()
        for key in [k for k, s in self._keys.items() if s.expires_at <= now]:
            del self._keys[key]


async def create_client_secret(request: web.Request, front: Any) -> web.Response:
    body = await _json_body(request)
    after = body.get("expires_after") or {}
    if not isinstance(after, dict) or after.get("anchor", "created_at") != "created_at":
        raise OpenAIError(400, "expires_after must be {anchor: created_at, seconds}", param="expires_after",
                          code="invalid_value")
    low, high, default = SECRET_TTL_S
    seconds = after.get("seconds", default)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise OpenAIError(400, f"expires_after.seconds must be an integer {low}..{high}",
                          param="expires_after.seconds", code="invalid_value")
    session = body.get("session")
    config = _session_config(session, await front.recognizer_name(request))
    key, secret = front.secrets.issue(seconds, session, request.get(TOKEN_KEY), request.get(BEARER_KEY))
    return web.json_response({"value": key, "expires_at": int(secret.expires_at),
                              "session": config.session_object()})


async def create_call(request: web.Request, front: Any) -> web.Response:
    """An SDP offer in, the call's SDP answer out."""
    from rtmedia.web.webrtc.peer import OfferError

    calls = front.upstream.calls
    if calls is None:
        raise OpenAIError(404, "WebRTC calls are not served by this front", code="not_found")
    sdp, session = await _offer(request)
    secret = front.secrets.get(request.get(SECRET_KEY))
    if session is None and secret is not None:
        session = secret.session
    config = _session_config(session, await front.recognizer_name(request))
    translator = Translator(config, webrtc=True)
    try:
        peer, answer = await calls.answer(sdp, request, translator)
    except OfferError as exc:
        raise OpenAIError(exc.status, exc.message, "server_error" if exc.status >= 500 else "invalid_request_error",
                          code=exc.reason or ("server_error" if exc.status >= 500 else "invalid_offer"),
                          headers=exc.headers) from None
    call_id = CALL_PREFIX + peer.id
    return web.Response(status=201, text=answer, content_type="application/sdp",
                        headers={"Location": f"/v1/realtime/calls/{call_id}"})


async def hangup(request: web.Request, front: Any) -> web.Response:
    peer = _own_call(front, request.match_info["call_id"], request)
    await peer.close("hung up by the client")
    return web.Response(status=200)


async def attach(request: web.Request, ws: web.WebSocketResponse, front: Any) -> web.WebSocketResponse:
    """A control socket on a call: the call's events go to it too, its events go to the call."""
    peer = _own_call(front, request.query["call_id"], request)
    outbox: asyncio.Queue[str | None] = asyncio.Queue(SIDEBAND_EVENTS)
    await ws.prepare(request)
    peer.sidebands.add(outbox)

    async def forward() -> None:
        while (text := await outbox.get()) is not None:
            await asyncio.wait_for(ws.send_str(text), front.realtime.send_timeout_s)

    sender = asyncio.ensure_future(forward())
    front.sockets += 1
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                peer.on_api_message(message.data)
            elif message.type != WSMsgType.BINARY:
                break
            if sender.done():
                break
    finally:
        front.sockets -= 1
        peer.sidebands.discard(outbox)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
        await ws.close()
    return ws


def _own_call(front: Any, call_id: str, request: web.Request) -> Any:
    calls = front.upstream.calls
    peer = calls.own_peer(call_id[len(CALL_PREFIX):], request) if calls is not None and \
        call_id.startswith(CALL_PREFIX) else None
    if peer is None or peer.translator is None:
        raise OpenAIError(404, "no such call (it may have ended)", param="call_id", code="call_not_found")
    return peer


def _session_config(session: Any, recognizer: str) -> RealtimeConfig:
    """The new session's config: the API's defaults, then `session` (session.update's object) applied."""
    try:
        return new_config(session=session, recognizer=recognizer)
    except RealtimeError as exc:
        raise OpenAIError(400, exc.message, param=exc.param, code=exc.code) from None


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise OpenAIError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object", code="invalid_json")
    return body


async def _offer(request: web.Request) -> tuple[str, dict[str, Any] | None]:
    """(the SDP offer, the session JSON or None) of a calls request."""
    kind = request.content_type
    if kind == "application/sdp":
        return await request.text(), None
    if kind != "multipart/form-data":
        raise OpenAIError(415, f"send the SDP offer as application/sdp, or multipart/form-data with sdp and session; "
                               f"not {kind[:60]!r}", code="unsupported_content_type")
    sdp, session = None, None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if part.name == "sdp":
                sdp = await part.text()
            elif part.name == "session":
                session = json.loads(await part.text())
    except ValueError as exc:
        raise OpenAIError(400, f"the multipart body is not readable: {str(exc)[:120]}", code="invalid_multipart") from None
    if not sdp:
        raise OpenAIError(400, "the multipart body has no sdp part", param="sdp", code="missing_required_parameter")
    if session is not None and not isinstance(session, dict):
        raise OpenAIError(400, "session must be a JSON object", param="session", code="invalid_value")
    return sdp, session

