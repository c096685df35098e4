"""Server interceptor: admission gate (warming up, draining), undecodable requests, gRPC metrics.

A method a servicer leaves to its generated default (which raises NotImplementedError, as
grpc_health's servicer does for Health/List) ends with UNIMPLEMENTED and the reason
UNIMPLEMENTED, without the traceback grpc would log for it.

A request message that does not decode ends its call with INVALID_ARGUMENT and the reason
UNDECODABLE_REQUEST, on every method, wherever the servicer reads its requests (a reader
task of a duplex stream included): the interceptor's deserializer hands the servicer a
marker instead of raising inside grpc, and the call is ended from the handler. It is logged
without a traceback, at most once a minute per peer."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from rtmedia.protocol.errors import rich_status
from rtmedia.server.observe.metrics import Metrics

log = logging.getLogger("rtmedia.rpc")
UNDECODABLE_LOG_S = 60.0  # a peer's undecodable requests are logged at most this often
UNDECODABLE_PEERS = 4096  # peers remembered for that (the oldest are forgotten)
# Calls refused while warming up or draining: rtmedia's own services and the Riva speech API.
GATED_PREFIX = ("/rtmedia.v1.", "/nvidia.riva.")
WRITE_SETTLE_S = 5.0  # how long an undecodable request's status waits for a write under way


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC (grpc_server_handled_total / handling_seconds) and turns
    rtmedia (and Riva) calls away with UNAVAILABLE while the server is not serving."""

    def __init__(self, metrics: Metrics, refusal: Callable[[], tuple[str, str] | None]) -> None:
        self._metrics = metrics
        # Returns (reason, message) while new rtmedia calls must be refused.
        self._refusal = refusal
        self._logged: dict[str, float] = {}  # peer -> when its last undecodable request was logged

    def _log_undecodable(self, peer: str, method: str, bad: Undecodable) -> None:
        now = time.monotonic()
        if now - self._logged.get(peer, -UNDECODABLE_LOG_S) < UNDECODABLE_LOG_S:
            return
        self._logged.pop(peer, None)
        self._logged[peer] = now
        while len(self._logged) > UNDECODABLE_PEERS:
            del self._logged[next(iter(self._logged))]
        log.warning("undecodable request", extra={"method": method, "peer": peer, "bytes": bad.size,
                                                  "error": bad.error})

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        service, _, name = method.lstrip("/").rpartition("/")
        kind = _kind(handler)
        behavior = getattr(handler, kind)
        gated = method.startswith(GATED_PREFIX)
        handled = self._metrics.grpc_handled
        seconds = self._metrics.grpc_handling_seconds.labels(_TYPES[kind], service, name)

        def finish(context, started: float, error: BaseException | None) -> None:
            code = context.code()
            if code is None:
                code = grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
            if isinstance(error, asyncio.CancelledError):
                code = grpc.StatusCode.CANCELLED
            name_ = code.name if isinstance(code, grpc.StatusCode) else str(code)
            elapsed = time.perf_counter() - started
            handled.labels(_TYPES[kind], service, name, name_).inc()
            seconds.observe(elapsed)
            # Health probes and reflection at debug level: they would drown the access log.
            level = logging.INFO if gated else logging.DEBUG
            log.log(level, "rpc", extra={"method": method, "code": name_, "seconds": round(elapsed, 4),
                                         "peer": context.peer()})

        async def refuse(context) -> None:
            refusal = self._refusal() if gated else None
            if refusal is not None:
                await context.abort_with_status(rich_status(grpc.StatusCode.UNAVAILABLE, *refusal))

        async def undecodable(context, bad: Undecodable) -> None:
            self._log_undecodable(context.peer(), method, bad)
            await context.abort_with_status(rich_status(
                grpc.StatusCode.INVALID_ARGUMENT, "UNDECODABLE_REQUEST",
                f"request {bad.index} of {name} ({bad.size} bytes) is not a valid {bad.type_name} message"))

        streaming_requests = handler.request_streaming
        behavior = _checked(behavior, streaming_requests, inspect.isasyncgenfunction(behavior), undecodable)

        async def unimplemented(context) -> None:
            await context.abort_with_status(rich_status(
                grpc.StatusCode.UNIMPLEMENTED, "UNIMPLEMENTED", f"{method} is not implemented by this server"))

        if inspect.isasyncgenfunction(behavior):
            async def stream_behavior(request, context):
                started, error = time.perf_counter(), None
                try:
                    await refuse(context)
                    async for response in behavior(request, context):
                        yield response
                except NotImplementedError:  # a servicer's generated default: not a server failure
                    await unimplemented(context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, started, error)
            wrapped = stream_behavior
        else:
            async def unary_behavior(request, context):
                started, error = time.perf_counter(), None
                try:
                    await refuse(context)
                    return await behavior(request, context)
                except NotImplementedError:  # a servicer's generated default: not a server failure
                    await unimplemented(context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, started, error)
            wrapped = unary_behavior
        return handler._replace(**{kind: wrapped}, request_deserializer=_safe(handler.request_deserializer))


class Undecodable:
    """What the interceptor's deserializer returns for a message that does not decode."""

    def __init__(self, size: int, error: BaseException, type_name: str) -> None:
        self.size, self.error, self.type_name = size, f"{type(error).__name__}: {error}", type_name
        self.index = 1  # its place in the call's requests, from 1


class UndecodableRequest(Exception):
    """Raised where a servicer reads a request that did not decode; the handler ends the call."""

    def __init__(self, bad: Undecodable) -> None:
        super().__init__(bad.error)
        self.bad = bad


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request"

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a deserializer raises
            return Undecodable(len(data), exc, type_name)

    return deserialize


def _checked(behavior: Any, streaming: bool, generator: bool,
             undecodable: Callable[[Any, Undecodable], Awaitable[None]]) -> Any:
    """`behavior` whose requests never carry an Undecodable: a unary call ends at once; a
    stream of requests raises UndecodableRequest where it is read and the handler, told at
    the same moment, ends the call (a servicer may read in a task of its own)."""
    if not streaming:
        if generator:
            async def unary_gen(request, context):
                if isinstance(request, Undecodable):
                    await undecodable(context, request)
                async for response in behavior(request, context):
                    yield response
            return unary_gen

        async def unary(request, context):
            if isinstance(request, Undecodable):
                await undecodable(context, request)
            return await behavior(request, context)
        return unary

    def requests_of(iterator: AsyncIterator[Any], bad: asyncio.Future[Undecodable]) -> AsyncIterator[Any]:
        async def requests() -> AsyncIterator[Any]:
            index = 0
            async for request in iterator:
                index += 1
                if isinstance(request, Undecodable):
                    request.index = index
                    if not bad.done():
                        bad.set_result(request)
                    raise UndecodableRequest(request)
                yield request
        return requests()

    if generator:
        async def stream_gen(request_iterator, context):
            bad: asyncio.Future[Undecodable] = asyncio.get_running_loop().create_future()
            try:
                async for response in behavior(requests_of(request_iterator, bad), context):
                    yield response
            except UndecodableRequest as exc:
                await undecodable(context, exc.bad)
        return stream_gen

    async def stream(request_iterator, context):
        bad: asyncio.Future[Undecodable] = asyncio.get_running_loop().create_future()
        writes = WholeWrites(context)
        task = asyncio.ensure_future(behavior(requests_of(request_iterator, bad), writes))
        try:
            await asyncio.wait({task, bad}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise
        if not bad.done():
            return task.result()
        if task.done():
            if not task.cancelled():
                task.exception()  # the servicer's own ending gives way to the status below
        else:  # a reader task found it: stop the servicer, then end the call
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await writes.settled(WRITE_SETTLE_S)
        await undecodable(context, bad.result())
    return stream


class WholeWrites:
    """A servicer's context whose writes run to their end even when the servicer is cancelled
    mid-write. grpc's core goes on sending a message whose write was cancelled, and refuses the
    call's status while it does (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS: the call would never
    end), so the status waits for `settled()`."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._pending: set[asyncio.Future[None]] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        write = asyncio.ensure_future(self._context.write(message))
        self._pending.add(write)
        write.add_done_callback(self._ended)
        await asyncio.shield(write)

    def _ended(self, write: asyncio.Future[None]) -> None:
        self._pending.discard(write)
        if not write.cancelled():
            write.exception()  # a write the cancelled servicer no longer awaits fails unseen (a client gone)

    async def settled(self, within_s: float) -> None:
        """Once the writes under way have ended (or `timeout` has passed: a client that reads nothing)."""
        if self._pending:
            await asyncio.wait(self._pending, timeout=within_s)


_TYPES = {
    "unary_unary": "unary",
    "unary_stream": "server_stream",
    "stream_unary": "client_stream",
    "stream_stream": "bidi_stream",
}


def _kind(handler: grpc.RpcMethodHandler) -> str:
    for kind in _TYPES:
        if getattr(handler, kind) is not None:
            return kind
    raise ValueError("handler has no behavior")
