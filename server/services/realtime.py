"""RealtimeService.Converse: one duplex speech session per stream (docs/protocol.md#sessions).

A client may say how it reached the server in the call's `rtmedia-transport` metadata
(`grpc`, the default; `webrtc`: the bridge; `openai-ws`, `openai-webrtc`: the OpenAI Realtime
front; `twilio`: a phone call through Twilio); `rtmedia_transport_sessions_active{transport}`
counts the open sessions by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import grpc
from rtmedia.engines.heap import trim_heap
from rtmedia.protocol.errors import abort
from rtmedia.protocol.tokens import Token
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.observe.metrics import TRANSPORTS
from rtmedia.server.observe.recording import RecordingPolicy, Recordings
from rtmedia.server.security.auth import Quotas, caller
from rtmedia.server.security.interceptors import UndecodableRequest
from rtmedia.server.session.config import SessionSettings
from rtmedia.server.session.session import Limits, Session, SessionContext
from rtmedia.v1 import realtime_pb2_grpc

if TYPE_CHECKING:
    from rtmedia.server.observe.tracing import Tracing

CLOSE_LINGER_S = 1.0  # after session.closed: how long the stream waits for the client's half-close

log = logging.getLogger(__name__)
HOUSEKEEPING_S = 1.0
TRIM_EVERY = 10  # housekeeping rounds between two heap trims
TRANSPORT_KEY = "rtmedia-transport"


def transport_of(metadata: Any) -> str:
    """The transport label of a call: its `rtmedia-transport` metadata, "grpc" without one,
    "other" for a value rtmedia does not know."""
    value = next((v for k, v in metadata or () if k == TRANSPORT_KEY), None)
    if value is None:
        return "grpc"
    value = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return value if value in TRANSPORTS else "other"


async def to_the_end(coro: Any) -> None:
    """Await `coro` to its end even when the awaiting task is cancelled meanwhile (the
    cancellation is raised once it ended). A session's release must not stop half way: when a
    client vanishes while the server is sending to it, the failed send may end the writer
    before the call's cancellation arrives, which then lands in the release; cut there, the
    session stayed in `sessions` for good, and its ASR stream open."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class RealtimeService(realtime_pb2_grpc.RealtimeServiceServicer):
    """Admits sessions, runs each stream's reader and writer, and closes sessions on
    idle timeout, max duration, disconnect and drain."""

    def __init__(self, access: EngineAccess, max_sessions: int = 256, lm_slots: int = 16,
                 limits: Limits | None = None, defaults: SessionSettings | None = None,
                 capacity: int = 0, refuse_at_capacity: bool = True, replica: str = "") -> None:
        self.metrics = access.metrics
        self.max_sessions = max_sessions
        self.capacity = capacity or max_sessions
        self.refuse_at_capacity = refuse_at_capacity and self.capacity < max_sessions
        self.replica = replica  # sent as rtmedia-replica initial metadata
        self.metrics.sessions_capacity.set(self.capacity)
        self.context = SessionContext(access, limits or Limits(), max_sessions, lm_slots)
        self.defaults = defaults or SessionSettings()
        self.sessions: dict[str, Session] = {}
        self.draining = False
        self._all_closed = asyncio.Event()
        self._housekeeper: asyncio.Task[None] | None = None
        self.quotas = Quotas()
        self.recordings = Recordings(RecordingPolicy(), self.metrics)  # none (`record` sets the server's)
        self.tracing: Tracing | None = None  # each session's trace, when tracing is on (server/observe/tracing.py)

    def record(self, recordings: Recordings) -> None:
        """Record sessions by `recordings`' policy (server/observe/recording.py): new sessions start with
        its `recording` setting, and a session.update's is checked against it."""
        self.recordings = recordings
        self.defaults = dataclasses.replace(self.defaults, recording=recordings.policy.setting())
        self.context = dataclasses.replace(self.context, recording=recordings.policy)

    def start(self) -> None:
        self._housekeeper = asyncio.create_task(self._housekeeping(), name="realtime-housekeeping")
        self.recordings.start()

    async def Converse(self, request_iterator, context) -> None:
        if self.refuse_at_capacity and len(self.sessions) >= self.capacity:
            self.metrics.sessions_total.labels("rejected").inc()
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "AT_CAPACITY",
                        f"this replica is at its capacity of {self.capacity} sessions; open the session on "
                        "another replica or retry later")
        if len(self.sessions) >= self.max_sessions:
            self.metrics.sessions_total.labels("rejected").inc()
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "MAX_SESSIONS",
                        f"the server is at its limit of {self.max_sessions} concurrent sessions; retry later")
        token = caller()
        if (over := self.quotas.admit(token)) is not None:
            self.metrics.sessions_total.labels("rejected").inc()
            self.metrics.auth_refused.labels("QUOTA").inc()
            why, retry_after = over
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA", f"{why}; retry later",
                        retry_after_s=f"{retry_after:g}")
        try:
            await self._converse(request_iterator, context, token)
        finally:
            self.quotas.release(token)
            if token is not None:
                self.metrics.token_sessions.labels(token.name).set(self.quotas.active(token.name))

    async def _converse(self, request_iterator, context, token: Token | None) -> None:
        session = Session(f"sess_{uuid.uuid4().hex[:12]}", self.context, self.defaults)
        session.caller = token.name if token is not None else None
        session.transport = transport_of(context.invocation_metadata())
        if self.tracing is not None:  # the call's traceparent continues into the session's trace
            session.replies.trace = self.tracing.session(session.id, session.caller, session.transport,
                                                         context.invocation_metadata(), session.settings)
        self.sessions[session.id] = session
        self.metrics.sessions_active.set(len(self.sessions))
        self.metrics.transport_sessions.labels(session.transport).inc()
        self.metrics.sessions_total.labels("admitted").inc()
        if token is not None:
            self.metrics.token_sessions.labels(token.name).set(self.quotas.active(token.name))
        log.info("session opened", extra={"session_id": session.id, "peer": context.peer(), "token": session.caller,
                                          "transport": session.transport})
        recordings = self.recordings if self.recordings.enabled else None
        if recordings is not None:
            recordings.sync(session)
        reader = asyncio.create_task(self._read(session, request_iterator, recordings),
                                     name=f"session-{session.id}-reader")
        outcome = "completed"
        session.writer = asyncio.current_task()
        try:
            if self.replica:
                await context.send_initial_metadata((("rtmedia-replica", self.replica),))
            created = session.created_event()
            if recordings is not None:
                recordings.sent(session, created)
            await context.write(created)
            while (event := await session.outbox.get(session.replies.epoch)) is not None:
                if recordings is not None:
                    recordings.sent(session, event)
                await context.write(event)
            # session.closed is out: the stream ends once the client half-closes (or CLOSE_LINGER_S
            # later). Ended while the client still sends, a proxy resets the request half, which
            # may reach the client as CANCELLED instead of OK (HAProxy sends RST_STREAM CANCEL).
            await asyncio.wait({reader}, timeout=CLOSE_LINGER_S)
        except asyncio.CancelledError:
            if not session.outbox.failed:
                outcome = "cancelled"
                raise
            outcome = "failed"  # the client kept not reading: its outbox let go of everything
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # the session's own cancel
        finally:
            await to_the_end(self._release(session, reader, outcome))
        if outcome == "failed":  # the status goes out once the client reads what is in flight (or is gone)
            limits = self.context.limits
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "CLIENT_TOO_SLOW",
                        f"the client did not read its events: more than {limits.max_outbox_events} events or "
                        f"{limits.max_outbox_bytes} bytes were waiting twice in a row")

    async def _release(self, session: Session, reader: asyncio.Task[None], outcome: str) -> None:
        """Free everything the session holds and forget it."""
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        try:
            await session.close()
        finally:
            self.recordings.closed(session)
            if session.replies.trace is not None:
                session.replies.trace.end(session.closing_reason or outcome, session.settings)
            del self.sessions[session.id]
            self.metrics.transport_sessions.labels(session.transport).dec()
            if not self.sessions:
                self._all_closed.set()
            if self.draining:
                self.metrics.sessions_draining.set(len(self.sessions))
            self.metrics.sessions_active.set(len(self.sessions))
            self.metrics.sessions_total.labels(outcome).inc()
            log.info("session closed", extra={"session_id": session.id, "reason": session.closing_reason or outcome,
                                              "token": session.caller})

    async def _read(self, session: Session, request_iterator: Any, recordings: Recordings | None = None) -> None:
        """The reader: every client event goes to the session as it arrives (a draining session
        still hears the turn in flight), once what the one before started is in place
        (`Session.settled`). Once the session is closed, what the client had in flight
        is read and dropped (session.closed said so) until it half-closes. A request that does not
        decode ends the call (server/security/interceptors.py ends it with INVALID_ARGUMENT, cancelling the
        writer): the session keeps that as its closing reason, so that its end is logged with it
        and not as a cancellation."""
        try:
            async for request in request_iterator:
                await session.settled()
                if session.outbox.closed:
                    continue
                if recordings is None:
                    session.handle(request)
                    continue
                before = session.input_ms  # (the session clock: a recorded chunk's place)
                session.handle(request)
                if request.WhichOneof("event") == "session_update":
                    recordings.sync(session)  # a session that asks is recorded from here
                recordings.received(session, request, before)
        except UndecodableRequest:
            if not session.outbox.closed:  # else session.closed went out already, with its reason
                session.closing_reason = "undecodable_request"
            raise
        if session.outbox.closed:
            return
        # The client finished sending: let a response in flight complete, then close.
        response = session.response
        if response is not None and response.task is not None:
            await asyncio.wait([response.task])
        session.finish("client_closed")

    async def _housekeeping(self) -> None:
        for round_ in itertools.count(1):
            await asyncio.sleep(HOUSEKEEPING_S)
            if round_ % TRIM_EVERY == 0:  # what closed sessions and large messages freed goes back
                await asyncio.to_thread(trim_heap)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                settings = session.settings
                if now - session.started > settings.max_session_s:
                    session.finish("max_session_duration")
                elif now - session.last_input > settings.idle_timeout_s and not session.responding:
                    session.finish("idle_timeout")

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: every session finishes what is in flight (a turn being spoken is heard to its
        end and answered, a reply goes out in full), then closes with
        session.closed{server_shutdown}; at the grace deadline the rest are closed."""
        self.draining = True
        for session in list(self.sessions.values()):
            session.finish("server_shutdown")
        self.metrics.sessions_draining.set(len(self.sessions))
        if self.sessions:
            self._all_closed.clear()  # set whenever the server emptied before
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace_s)
        for session in list(self.sessions.values()):
            session.shutdown_now()

    async def close(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        await self.recordings.close()
