"""Bearer tokens on the gRPC port, and per-token session quotas.

With a token table (rtmedia.protocol.tokens: `--auth-tokens FILE` or RTMEDIA_AUTH_TOKENS),
every call but the health checks needs `authorization: Bearer TOKEN` metadata; a missing
or unknown token ends the call with UNAUTHENTICATED (reason UNAUTHENTICATED) before the
servicer runs, and says no more than that. The token's name (never the token) is the
call's `caller()` for sessions, metrics and logs. The table can be swapped (`tokens`) on
SIGHUP; calls already admitted keep going.

Quotas count Converse sessions per token name: at most `max_sessions` at once and
`sessions_per_minute` opened in any 60 s. A session over either is refused with
RESOURCE_EXHAUSTED, reason QUOTA, and ErrorInfo metadata `retry_after_s`.
"""

from __future__ import annotations

import contextvars
import inspect
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable

import grpc
from rtmedia.protocol.errors import rich_status
from rtmedia.protocol.tokens import Token, TokenTable, bearer

OPEN_PREFIX = ("/grpc.health.v1.Health/",)  # probes need no token
WINDOW_S = 60.0
_CALLER: contextvars.ContextVar[Token | None] = contextvars.ContextVar("rtmedia_caller", default=None)


def caller() -> Token | None:
    """The token of the call being served (None: authentication is off)."""
    return _CALLER.get()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call's bearer token against the table in force."""

    def __init__(self, tokens: TokenTable, refused: Callable[[str], None] = lambda reason: None) -> None:
        self.tokens = tokens
        self._refused = refused  # counts a refusal (metrics), by reason

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.tokens.enabled or handler_call_details.method.startswith(OPEN_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        token = self.tokens.match(bearer(metadata.get("authorization")))
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                    if getattr(handler, k) is not None)
        behavior = getattr(handler, kind)
        if token is None:
            self._refused("UNAUTHENTICATED")
            return handler._replace(**{kind: _refusing(behavior)})
        return handler._replace(**{kind: _as_caller(behavior, token)})


def _refusing(behavior):
    status = rich_status(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED",
                         "a valid bearer token is required (authorization metadata)")
    if inspect.isasyncgenfunction(behavior):
        async def refuse_stream(request, context):
            await context.abort_with_status(status)
            yield  # pragma: no cover  (an async generator, as the handler kind requires)
        return refuse_stream

    async def refuse(request, context):
        await context.abort_with_status(status)
    return refuse


def _as_caller(behavior, token: Token):
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            _CALLER.set(token)
            async for response in behavior(request, context):
                yield response
        return stream

    async def unary(request, context):
        _CALLER.set(token)
        return await behavior(request, context)
    return unary


class Quotas:
    """Per-token session counts (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._active: defaultdict[str, int] = defaultdict(int)
        self._opened: defaultdict[str, deque[float]] = defaultdict(deque)

    def active(self, name: str) -> int:
        return self._active[name]

    def admit(self, token: Token | None) -> tuple[str, float] | None:
        """Count a new session of `token`; or (why, retry after seconds) when over its quota."""
        if token is None:
            return None
        now, opened = self._clock(), self._opened[token.name]
        while opened and now - opened[0] >= WINDOW_S:
            opened.popleft()
        if token.max_sessions is not None and self._active[token.name] >= token.max_sessions:
            return f"the token's limit of {token.max_sessions} concurrent sessions is reached", 1.0
        if token.sessions_per_minute is not None and len(opened) >= token.sessions_per_minute:
            retry = opened[len(opened) - token.sessions_per_minute] + WINDOW_S - now
            return (f"the token's limit of {token.sessions_per_minute} new sessions a minute is reached",
                    max(1.0, math.ceil(retry)))
        opened.append(now)
        self._active[token.name] += 1
        return None

    def release(self, token: Token | None) -> None:
        if token is not None and self._active[token.name] > 0:
            self._active[token.name] -= 1
