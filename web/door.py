"""One skeleton for the web front's doors: `Door`, a carrier's end of one `Converse` session.

A door (a WebRTC peer, a Realtime WebSocket, a Twilio call, a SIP call) speaks its carrier on
the outside and the protocol on the inside. What every door does the same way lives here, once:

- `open_converse`: the session on the front's channel (web/server_channel.py), carrying the
  door's `rtmedia-transport`, up once `session.created` came (within `open_timeout_s`); a
  failure cancels the stream and raises.
- `pump_input`: the carrier's requests (`requests()`: by default the `outgoing` queue, until
  None) to the session, in order. It stops quietly when the session takes no more (after
  `session.closed`, or a send the session refused): the output pump tells why.
- `pump_output`: the session's events, each dispatched by its canonical dotted name
  (`rtmedia.protocol.events.SERVER_EVENTS`) to the method a subclass marked `@on(name)`, else
  to `on_event`. `session.closed` sets `server_closed` before its handler runs; a handler that
  returns `STOP` ends the pump. A failed stream becomes one `Fault` (`fault_of`), handed to
  `on_fault`.
- `converse`: both pumps until either ends, then the close rule.
- the close rule (`end_session`): unless the server has closed the session, `session.close`
  (reason `client`) and the half-close; then at most `CLOSE_WAIT_S` for the server's end of the
  stream (the output pump ends at `session.closed`); then the stream is cancelled.
- the error mapping (`fault_of`): a failed session as a `Fault` whose `kind` each door says in
  its carrier's words (an HTTP status, a WebSocket close code, a SIP status, an API error event).

As a transport base with one serializer per provider: a new carrier is a subclass that says how
its messages become requests (`requests`) and which events it answers (`@on`), not a copy of a
door.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import grpc
from rtmedia.clients import events
from rtmedia.clients.errors import RtmediaError
from rtmedia.clients.session import RealtimeSession
from rtmedia.protocol.events import SERVER_EVENTS, event_type
from rtmedia.v1 import realtime_pb2

CLOSE_WAIT_S: Final = 2.0  # how long a door waits for each step of the server's end of a session it closes
OPEN_TIMEOUT_S: Final = 10.0  # for session.created, in the doors that bound the open
STOP: Final = True  # a handler's answer that ends the output pump

_S = grpc.StatusCode
# Fault kinds -> the HTTP status of a door that answers in HTTP.
HTTP_STATUS: dict[str, int] = {
    "unauthenticated": 401, "forbidden": 403, "quota": 429, "refused": 503, "unreachable": 502,
    "failed": 502, "timeout": 504, "cancelled": 499, "ended": 200,
}


def on(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method of a `Door` as the handler of these server events (canonical dotted names)."""
    unknown = [name for name in names if name not in SERVER_EVENTS]
    if unknown or not names:
        raise ValueError(f"not server events (rtmedia.protocol.events.SERVER_EVENTS): {unknown or names}")

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        method.door_events = (*getattr(method, "door_events", ()), *names)  # type: ignore[attr-defined]
        return method

    return mark


@dataclass(frozen=True)
class Fault:
    """A session that failed, as every door tells it: `kind` (a key of HTTP_STATUS), the gRPC
    status, its ErrorInfo reason ("" without one), details and metadata."""

    kind: str
    code: grpc.StatusCode
    details: str
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    error: RtmediaError | None = None

    @property
    def quiet(self) -> bool:
        """The door's own end of the stream, or the end the server announced: nothing to report."""
        return self.kind in ("cancelled", "ended")

    @property
    def busy(self) -> bool:
        """The server at capacity or over a quota (RESOURCE_EXHAUSTED): worth trying later."""
        return self.code == _S.RESOURCE_EXHAUSTED

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.kind]

    @property
    def summary(self) -> str:
        """`CODE: details (REASON)`, for logs and messages."""
        return f"{self.code.name}: {self.details}" + (f" ({self.reason})" if self.reason else "")


def fault_of(exc: BaseException, server_closed: bool = False) -> Fault:
    """The one error mapping: a failed open or session (an RtmediaError, or the open's timeout)
    as a Fault. `server_closed`: session.closed came before (grpc.aio may turn the stream's end
    that follows into INTERNAL when a write raced it, grpc/grpc#36066: it ended as announced)."""
    if isinstance(exc, TimeoutError):
        return Fault("timeout", _S.DEADLINE_EXCEEDED, "the rtmedia server did not open a session in time")
    if not isinstance(exc, RtmediaError):
        return Fault("failed", _S.UNKNOWN, f"{type(exc).__name__}: {exc}")
    code, reason = exc.code, exc.reason
    if code == _S.CANCELLED:
        kind = "cancelled"
    elif code == _S.INTERNAL and server_closed:
        kind = "ended"
    elif code == _S.UNAUTHENTICATED:
        kind = "unauthenticated"
    elif code == _S.PERMISSION_DENIED:
        kind = "forbidden"
    elif code == _S.RESOURCE_EXHAUSTED and reason == "QUOTA":
        kind = "quota"
    elif code in (_S.RESOURCE_EXHAUSTED, _S.UNAVAILABLE) and reason:  # capacity, draining, warming up
        kind = "refused"
    elif code == _S.UNAVAILABLE:
        kind = "unreachable"
    else:
        kind = "failed"
    return Fault(kind, code, exc.details, reason, dict(exc.metadata), exc)


class Door:
    """One carrier's end of one Converse session (see the module's docstring).

    Subclasses set `transport` (the `rtmedia-transport` the session carries; "" for none),
    `open_timeout_s` (None: unbounded), and mark their event handlers with `@on`.
    """

    transport: ClassVar[str] = ""
    open_timeout_s: ClassVar[float | None] = None
    input_queue: ClassVar[int] = 256  # requests the `outgoing` queue holds
    handlers: ClassVar[dict[str, str]] = {}  # canonical server event name -> method name (from @on)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                for name in getattr(value, "door_events", ()):
                    table[name] = attr
        cls.handlers = table

    def __init__(self) -> None:
        self.session: RealtimeSession | None = None
        self.server_closed = False  # session.closed (the session's last event) came
        self.outgoing: asyncio.Queue[realtime_pb2.ConverseRequest | None] = asyncio.Queue(self.input_queue)

    # ---- open -------------------------------------------------------------------------------------
    async def open_converse(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] = ()
                           ) -> events.SessionCreatedEvent:
        """The session up to `session.created`; any failure (RtmediaError, TimeoutError, a
        cancellation) cancels the stream and is raised."""
        tagged = (*metadata, ("rtmedia-transport", self.transport)) if self.transport else tuple(metadata)
        self.session = RealtimeSession(channel=channel, metadata=tagged)
        try:
            # Read first: a refusal (quota, capacity, draining) then arrives as the server's own status;
            # a write racing it may get grpc's "Internal error from Core" instead (grpc/grpc#36066).
            return await asyncio.wait_for(self.session.open(), self.open_timeout_s)
        except BaseException:
            self.session.cancel_stream()
            raise

    # ---- carrier -> session -----------------------------------------------------------------------
    async def requests(self) -> AsyncIterator[realtime_pb2.ConverseRequest]:
        """The carrier's requests, in order; by default the `outgoing` queue until None."""
        while (request := await self.outgoing.get()) is not None:
            yield request

    def put(self, request: realtime_pb2.ConverseRequest) -> bool:
        """Queue a request for the session without waiting; False when the queue is full."""
        try:
            self.outgoing.put_nowait(request)
        except asyncio.QueueFull:
            return False
        return True

    async def pump_input(self) -> None:
        assert self.session is not None
        async with contextlib.aclosing(self.requests()) as requests:
            async for request in requests:
                if self.server_closed:
                    return  # the session is over: the output pump ends the door
                try:
                    await self.session.send(request)
                except RtmediaError:
                    # The server ended the session while requests were on the way (session.closed, e.g.
                    # server_shutdown while draining): the output pump reports how.
                    return

    # ---- session -> carrier -----------------------------------------------------------------------
    async def pump_output(self) -> None:
        assert self.session is not None
        try:
            while (event := await self.session.next_event()) is not None:
                if await self.dispatch(event.proto) is STOP:
                    return
        except RtmediaError as exc:
            await self.on_fault(fault_of(exc, self.server_closed))
            return
        await self.on_stream_end()

    async def dispatch(self, msg: realtime_pb2.ConverseResponse) -> bool | None:
        """One server event to its handler by canonical name (`@on`), else to `on_event`."""
        name = event_type(msg)
        if name == "session.closed":
            self.server_closed = True
        method = self.handlers.get(name)
        result = getattr(self, method)(msg) if method is not None else self.on_event(name, msg)
        if inspect.isawaitable(result):
            result = await result
        return result

    def on_event(self, name: str, msg: realtime_pb2.ConverseResponse) -> Any:
        """An event no `@on` handler took (may be a coroutine; `STOP` ends the pump)."""
        return None

    async def on_fault(self, fault: Fault) -> None:
        """The session failed (the stream's end the door caused is a quiet Fault too)."""

    async def on_stream_end(self) -> None:
        """The session's stream ended (after session.closed, or cancelled by the door)."""

    # ---- both, and the end ------------------------------------------------------------------------
    async def converse(self) -> None:
        """Both pumps until either ends; then the close rule, and both are cancelled and awaited
        (`on_task_error` hears a pump's own failure)."""
        output = asyncio.ensure_future(self.pump_output())
        carrier = asyncio.ensure_future(self.pump_input())
        try:
            await asyncio.wait([output, carrier], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if carrier.done() and not output.done():  # the carrier left: the session ends with it
                await self.end_session(output)
            for task in (carrier, output):
                task.cancel()
            if self.session is not None:
                self.session.cancel_stream()
            for task in (carrier, output):
                with contextlib.suppress(asyncio.CancelledError):
                    try:
                        await task
                    except Exception as exc:
                        self.on_task_error(exc)

    def on_task_error(self, exc: Exception) -> None:
        """A pump that failed on its own (not the session: `on_fault`)."""

    async def end_session(self, output: asyncio.Future[Any] | None = None) -> None:
        """The close rule: unless the server closed the session, `session.close` (reason
        `client`) and the half-close, within CLOSE_WAIT_S; then at most CLOSE_WAIT_S for the
        output pump (the server's session.closed and the stream's end). The caller cancels
        the stream after."""
        session = self.session
        if session is None:
            return
        if not self.server_closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await session.event("session.close", reason="client")
                    await session.end_input()
        if output is not None and not output.done():
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(output), CLOSE_WAIT_S)
