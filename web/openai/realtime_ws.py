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
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import WSCloseCode, WSMsgType, web
from rtmedia.clients import events
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.session import RealtimeSession
from rtmedia.v1 import realtime_pb2
from rtmedia.web.app_keys import WS_PROTOCOL_KEY
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


class RealtimeSocket:
    """One `/v1/realtime` WebSocket and its Converse call."""

    def __init__(self, ws: web.WebSocketResponse, session: RealtimeSession, translator: Translator,
                 limits: RealtimeLimits) -> None:
        self.ws, self.session, self.translator, self.limits = ws, session, translator, limits
        self.closed_reason = ""
        self.server_closed = False  # session.closed came: nothing more is written to the call

    async def send(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await asyncio.wait_for(self.ws.send_str(json.dumps(event, separators=(",", ":"))),
                                   self.limits.send_timeout_s)

    async def run(self, first: list[realtime_pb2.ConverseResponse]) -> None:
        writer = asyncio.ensure_future(self._from_server(first))
        reader = asyncio.ensure_future(self._from_client())
        try:
            await asyncio.wait([writer, reader], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if reader.done() and not writer.done():  # the client left: the session ends with it
                with contextlib.suppress(Exception):
                    await self.session.event("session.close", reason="client")
                    await self.session.end_input()
                with contextlib.suppress(asyncio.TimeoutError, Exception):
                    await asyncio.wait_for(asyncio.shield(writer), 2)
            for task in (reader, writer):
                task.cancel()
            self.session.cancel_stream()
            for task in (reader, writer):
                with contextlib.suppress(asyncio.CancelledError):
                    try:
                        await task
                    except Exception:
                        log.exception("realtime socket task failed")
                        self.closed_reason = self.closed_reason or "server_error"
            if not self.ws.closed:
                code = CLOSE_REASONS.get(self.closed_reason, WSCloseCode.OK)
                await self.ws.close(code=code, message=self.closed_reason[:120].encode())

    async def _from_server(self, first: list[realtime_pb2.ConverseResponse]) -> None:
        try:
            for msg in first:
                await self.send(self.translator.from_server(msg))
            while (event := await self.session.next_event()) is not None:
                msg = event.proto
                if msg.WhichOneof("event") == "session_closed":  # the session half-closed its call
                    self.closed_reason, self.server_closed = msg.session_closed.reason, True
                    if self.closed_reason == "max_session_duration":
                        await self.send([self.translator.error(RealtimeError(
                            "session_expired", "the session reached its maximum duration"))])
                    return
                await self.send(self.translator.from_server(msg))
        except RtmediaError as exc:
            if exc.code != grpc.StatusCode.CANCELLED:
                error = from_rpc(exc)
                with contextlib.suppress(Exception):
                    await self.send([self.translator.error(RealtimeError(
                        error.code or "server_error", error.message, error.param,
                        SERVER_ERROR if error.status >= 500 else "invalid_request_error"))])
                self.closed_reason = error.code or "server_error"
        except (TimeoutError, ConnectionResetError):
            self.closed_reason = "client_too_slow"

    async def _from_client(self) -> None:
        try:
            await self._read_client()
        except TimeoutError:
            self.closed_reason = "client_too_slow"
        except ConnectionResetError:  # the client went away while the front answered it
            pass

    async def _read_client(self) -> None:
        async for message in self.ws:
            if message.type == WSMsgType.TEXT:
                await self._client_event(message.data)
            elif message.type == WSMsgType.BINARY:
                await self.send([self.translator.error(RealtimeError(
                    "invalid_event", "binary frames are not events: send each event as a JSON text frame"))])
            else:  # an error (a frame over max_frame_bytes) or the close
                return

    async def _client_event(self, text: str) -> None:
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
            await self.session.send(request)
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


async def open_call(front: Any, request: web.Request, translator: Translator, transport: str
                    ) -> tuple[RealtimeSession, list[realtime_pb2.ConverseResponse]]:
    """A Converse session, configured; the server's first answers (session.created and the
    initial session.updated). A refusal (admission, tokens, draining) is an OpenAIError."""
    if front.upstream.draining():
        raise OpenAIError(503, "the server is shutting down (draining); connect to another replica or retry shortly",
                          SERVER_ERROR, code="draining", headers={"Retry-After": "5"})
    metadata = (*front.upstream.metadata(request), ("rtmedia-transport", transport))
    session = RealtimeSession(channel=front.upstream.channel(), metadata=metadata)
    try:
        # Read first: a refusal then arrives as the server's own status (a write racing it may be
        # reported as INTERNAL instead, grpc/grpc#36066).
        first = [(await session.open()).proto]
        await session.send(translator.initial())
        while (event := await session.next_event()) is not None:
            first.append(event.proto)
            if isinstance(event, events.SessionUpdatedEvent):
                return session, first
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


async def serve_socket(request: web.Request, ws: web.WebSocketResponse, front: Any, config: RealtimeConfig,
                       transport: str) -> web.WebSocketResponse:
    translator = Translator(config)
    session, first = await open_call(front, request, translator, transport)
    try:
        await ws.prepare(request)
    except BaseException:
        session.cancel_stream()
        raise
    front.sockets += 1
    try:
        await RealtimeSocket(ws, session, translator, front.realtime).run(first)
    finally:
        front.sockets -= 1
    return ws
