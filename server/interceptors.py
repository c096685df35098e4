"""Server interceptor: admission gate (warming up, draining) and gRPC metrics."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable

import grpc
from rtmedia.protocol.errors import rich_status
from rtmedia.server.metrics import Metrics

log = logging.getLogger("rtmedia.rpc")
# Calls refused while warming up or draining: rtmedia's own services and the Riva speech API.
GATED_PREFIX = ("/rtmedia.v1.", "/nvidia.riva.")


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC (grpc_server_handled_total / handling_seconds) and turns
    rtmedia (and Riva) calls away with UNAVAILABLE while the server is not serving."""

    def __init__(self, metrics: Metrics, refusal: Callable[[], tuple[str, str] | None]) -> None:
        self._metrics = metrics
        # Returns (reason, message) while new rtmedia calls must be refused.
        self._refusal = refusal

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

        if inspect.isasyncgenfunction(behavior):
            async def stream_behavior(request, context):
                started, error = time.perf_counter(), None
                try:
                    await refuse(context)
                    async for response in behavior(request, context):
                        yield response
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
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, started, error)
            wrapped = unary_behavior
        return handler._replace(**{kind: wrapped})


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
