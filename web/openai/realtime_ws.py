"""`GET /v1/realtime`: OpenAI's Realtime API over a WebSocket, one rtmedia `Converse` session per
socket (docs/openai.md#realtime), so that `openai`'s `client.realtime.connect(model=...)` and
the frameworks built on it work against rtmedia by changing the base URL.

The handshake is refused in OpenAI's HTTP error shape before the upgrade when the model is
unknown, the front is draining, or the server does not admit the session (its limits,
tokens and quotas: the session counts against `--max-sessions` like any other, and carries
`rtmedia-transport: openai-ws` so the metrics tell the doors apart). Keys: `Authorization:
Bearer KEY` or, from a browser, the subprotocols `realtime` and `openai-insecure-api-key.KEY`
(the bridge's `authenticate`).

Once open, two pumps run: client text frames -> rtmedia.web.openai.realtime_events -> the call, and
the call -> the API's events -> the socket. Every client mistake (malformed JSON, an unknown
event, a refused field, bad base64, an event over `max_event_bytes`, a binary frame) is an
`error` event and the session goes on. A client that stops reading blocks the writer (aiohttp
waits for the socket to drain), which stops reading the call, so the server's bounded outbox
fills and it ends the session (`client_too_slow`); a send that waits `send_timeout_s` closes
the socket. Nothing is buffered without bound in the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web
from rtmedia.clients import events
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.session import RealtimeSession
from rtmedia.v1 import realtime_pb2
from rtmedia.web.app_keys import WS_PROTOCOL_KEY
from rtmedia.web.door import STOP, Door, Fault, on
from rtmedia.web.openai.openai_errors import SERVER_ERROR, OpenAIError, from_rpc
from rtmedia.web.openai.realtime_calls import attach
from rtmedia.web.openai.realtime_config import (
    DEFAULT_MODEL,
    REALTIME_MODELS,
    RealtimeConfig,
    RealtimeError,
    new_config,
)
from rtmedia.web.openai.realtime_events import Translator

log = logging.getLogger(__name__)
TRANSPORT = "openai-ws"
SUBPROTOCOL = "realtime"
# Close codes: 1000 for a session that ended, 1011 when the server failed it, 1008 for a client
# that stopped reading.
CLOSE_REASONS = {"client_too_slow": WSCloseCode.POLICY_VIOLATION, "server_error": WSCloseCode.INTERNAL_ERROR}


@dataclass(frozen=True)
class RealtimeLimits:
    """`max_event_bytes`: the largest client event served (a larger one up to `max_frame_bytes`
    gets an error event; beyond it the socket is closed with 1009, as no frame that size is read
    into memory); `send_timeout_s`: how long a send may wait for a client that does not read;
    `heartbeat_s`: WebSocket pings that find a vanished client."""

    max_event_bytes: int = 2 * 1024 * 1024
    max_frame_bytes: int = 8 * 1024 * 1024
    send_timeout_s: float = 10.0
    heartbeat_s: float = 20.0


class RealtimeSocket(Door):
    """One `/v1/realtime` WebSocket and its Converse call: the client's text frames become the
    call's requests through the translator (`requests`), and every server event goes out as
    the API's events (`on_event`)."""

    transport = TRANSPORT

    def __init__(self, ws: web.WebSocketResponse, session: RealtimeSession | None, translator: Translator,
                 limits: RealtimeLimits, transport: str = TRANSPORT) -> None:
        super().__init__()
        self.ws, self.session, self.translator, self.limits = ws, session, translator, limits
        self.transport = transport  # type: ignore[misc]
        self.closed_reason = ""
        self.first: list[realtime_pb2.ConverseResponse] = []

    async def send(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await asyncio.wait_for(self.ws.send_str(json.dumps(event, separators=(",", ":"))),
                                   self.limits.send_timeout_s)

    async def open_call(self, front: Any, request: web.Request) -> list[realtime_pb2.ConverseResponse]:
        """The Converse session, configured; the server's first answers (session.created and the
        initial session.updated). A refusal (admission, tokens, draining) is an OpenAIError."""
        if front.upstream.draining():
            raise OpenAIError(503, "the server is shutting down (draining); connect to another replica or retry "
                                   "shortly", SERVER_ERROR, code="draining", headers={"Retry-After": "5"})
        try:
            created = await self.open_converse(front.upstream.channel(), front.upstream.metadata(request))
        except RtmediaError as exc:
            raise from_rpc(exc) from None
        session, first = self.session, [created.proto]
        assert session is not None
        try:
            await session.send(self.translator.initial())
            while (event := await session.next_event()) is not None:
                first.append(event.proto)
                if isinstance(event, events.SessionUpdatedEvent):
                    return first
                if isinstance(event, events.ErrorEvent):  # the initial config was refused: a server this front does not fit
                    raise OpenAIError(502, f"the rtmedia server refused the session's config: {event.message}",
                                      SERVER_ERROR, code="server_error")
            raise OpenAIError(502, "the rtmedia server ended the session at once", SERVER_ERROR, code="server_error")
        except RtmediaError as exc:
            session.cancel_stream()
            raise from_rpc(exc) from None
        except BaseException:
            session.cancel_stream()
            raise

    async def run(self, first: list[realtime_pb2.ConverseResponse]) -> None:
        self.first = first
        try:
            await self.converse()
        finally:
            if not self.ws.closed:
                code = CLOSE_REASONS.get(self.closed_reason, WSCloseCode.OK)
                await self.ws.close(code=code, message=self.closed_reason[:120].encode())

    def on_task_error(self, exc: Exception) -> None:
        log.error("realtime socket task failed", exc_info=exc)
        self.closed_reason = self.closed_reason or "server_error"

    # ---- the call -> the client ----
    async def pump_output(self) -> None:
        try:
            for msg in self.first:
                await self.send(self.translator.from_server(msg))
            await super().pump_output()
        except (TimeoutError, ConnectionResetError):
            self.closed_reason = "client_too_slow"

    async def on_event(self, name: str, msg: realtime_pb2.ConverseResponse) -> None:
        await self.send(self.translator.from_server(msg))

    @on("session.closed")
    async def _closed(self, msg: realtime_pb2.ConverseResponse) -> bool:
        self.closed_reason = msg.session_closed.reason  # the session half-closed its call
        if self.closed_reason == "max_session_duration":
            await self.send([self.translator.error(RealtimeError(
                "session_expired", "the session reached its maximum duration"))])
        return STOP

    async def on_fault(self, fault: Fault) -> None:
        if fault.quiet or fault.error is None:
            return
        error = from_rpc(fault.error)
        with contextlib.suppress(Exception):
            await self.send([self.translator.error(RealtimeError(
                error.code or "server_error", error.message, error.param,
                SERVER_ERROR if error.status >= 500 else "invalid_request_error"))])
        self.closed_reason = error.code or "server_error"

    # ---- the client -> the call ----
    async def pump_input(self) -> None:
        try:
            await super().pump_input()
        except TimeoutError:
            self.closed_reason = "client_too_slow"
        except ConnectionResetError:  # the client went away while the front answered it
            pass

    async def requests(self) -> AsyncIterator[realtime_pb2.ConverseRequest]:
        async for message in self.ws:
            if message.type == WSMsgType.TEXT:
                async for request in self._client_event(message.data):
                    yield request
            elif message.type == WSMsgType.BINARY:
                await self.send([self.translator.error(RealtimeError(
                    "invalid_event", "binary frames are not events: send each event as a JSON text frame"))])
            else:  # an error (a frame over max_frame_bytes) or the close
                return

    async def _client_event(self, text: str) -> AsyncIterator[realtime_pb2.ConverseRequest]:
        if len(text) > self.limits.max_event_bytes:
            await self.send([self.translator.error(RealtimeError(
                "event_too_large", f"the event is {len(text)} bytes; the limit is {self.limits.max_event_bytes}; it "
                "was dropped (send audio in smaller appends)"))])
            return
        try:
            event = json.loads(text)
        except (ValueError, RecursionError) as exc:  # nested too deeply is not valid JSON here either
            await self.send([self.translator.error(RealtimeError("invalid_json", f"the event is not valid JSON: "
                                                                                 f"{str(exc)[:120]}"))])
            return
        try:
            requests, local = self.translator.from_client(event)
        except RealtimeError as exc:
            await self.send([self.translator.error(exc, getattr(exc, "event_id", None))])
            return
        for request in requests:
            if self.server_closed:
                return  # the session is over (session.closed went out): the socket closes next
            yield request
        await self.send(local)


async def realtime_socket(request: web.Request, front: Any) -> web.StreamResponse:
    """The `/v1/realtime` route of the OpenAI front (rtmedia.web.openai.openai_api.OpenAIFront)."""
    ws = web.WebSocketResponse(protocols=tuple(p for p in (SUBPROTOCOL, request.get(WS_PROTOCOL_KEY)) if p),
                               max_msg_size=front.realtime.max_frame_bytes, heartbeat=front.realtime.heartbeat_s,
                               compress=False)
    if not ws.can_prepare(request).ok:
        raise OpenAIError(400, "/v1/realtime is a WebSocket: connect with a WebSocket client (Upgrade: websocket)",
                          code="websocket_required")
    if "call_id" in request.query:
        return await attach(request, ws, front)
    model = request.query.get("model", DEFAULT_MODEL)
    intent = request.query.get("intent", "")
    if intent not in ("", "transcription"):
        raise OpenAIError(400, f"intent={intent[:40]!r}: the intents are transcription, or none", param="intent",
                          code="invalid_value")
    if intent != "transcription" and model not in REALTIME_MODELS:
        raise OpenAIError(404, f"the model {model[:100]!r} does not exist here; models: {', '.join(REALTIME_MODELS)}",
                          param="model", code="model_not_found")
    config = new_config(model, intent or "realtime", recognizer=await front.recognizer_name(request))
    return await serve_socket(request, ws, front, config, TRANSPORT)


async def serve_socket(request: web.Request, ws: web.WebSocketResponse, front: Any, config: RealtimeConfig,
                       transport: str) -> web.WebSocketResponse:
    socket = RealtimeSocket(ws, None, Translator(config), front.realtime, transport)
    first = await socket.open_call(front, request)
    assert socket.session is not None
    try:
        await ws.prepare(request)
    except BaseException:
        socket.session.cancel_stream()
        raise
    front.sockets += 1
    try:
        await socket.run(first)
    finally:
        front.sockets -= 1
    return ws
