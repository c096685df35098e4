"""The web port's error answers, and the log of requests aiohttp cannot parse.

Every error answer has one shape: the bridge's `{"error": "...", "reason": "..."}`, or OpenAI's
error object under /v1/ (rtmedia.web.openai.openai_errors); `json_errors` gives aiohttp's own
answers (no such route, method not allowed, body too large) that shape.

A request aiohttp cannot parse (a request line or header over its limit, a malformed header)
never reaches the app: aiohttp answers it 400 itself and logs "Error handling request" at
ERROR with the parser's traceback, each time, so anyone who can reach the port could flood the
log and trip alerts. `ServerLog`, aiohttp's server logger for the web port, logs it as one
WARNING line without a traceback instead, at most once per peer address every
UNPARSABLE_LOG_S (as the server logs an undecodable gRPC request); the 400 is aiohttp's as
before, and everything else reaches aiohttp's own logger unchanged.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger
from rtmedia.web.openai.openai_errors import http_error
from rtmedia.web.openai.openai_models import is_openai_path

log = logging.getLogger("rtmedia.web")

UNPARSABLE_LOG_S = 60.0  # a peer's unparsable requests are logged at most this often
UNPARSABLE_PEERS = 4096  # peers remembered for that (the oldest are forgotten)


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   reason: str | None = None) -> web.Response:
    """The one shape of every error answer: `{"error": "..."}`, with `"reason"` (a stable word:
    unauthenticated, quota, draining, ...) where a client acts on it."""
    body = {"error": message, **({"reason": reason} if reason else {})}
    return web.json_response(body, status=status, headers=headers)


def refusal(request: web.Request, status: int, message: str, headers: dict[str, str] | None = None,
            reason: str | None = None) -> web.Response:
    """An error answer in the shape of the API the request is for: OpenAI's under /v1/, else
    the bridge's."""
    if is_openai_path(request.path):
        return http_error(status, message, headers)
    return error_response(status, message, headers, reason)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own error answers (no such route, method not allowed, body too large) in the bridge's shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after", "www-authenticate")}
        return refusal(request, exc.status, f"{exc.reason}: {request.method} {request.path[:200]}", headers)


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger for the web port (the `logger` of its request handlers, given to
    the AppRunner): a request aiohttp could not parse becomes a rate-limited warning (above);
    anything else goes on to `logger` as aiohttp logged it."""

    def __init__(self, logger: logging.Logger = server_logger, interval_s: float = UNPARSABLE_LOG_S) -> None:
        super().__init__(logger, {})
        self.interval_s = interval_s
        self._logged: dict[str, float] = {}  # peer address -> when its last unparsable request was logged

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        """aiohttp's RequestHandler.handle_error logs ("Error handling request from %s",
        request.remote) with the exception that made it answer."""
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self.unparsable(str(args[0]) if args and args[0] else "unknown", exc)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)

    def unparsable(self, peer: str, exc: HttpProcessingError) -> None:
        """One warning per peer address per `interval_s` at most; the peers remembered are bounded."""
        now = time.monotonic()
        if now - self._logged.get(peer, -self.interval_s) < self.interval_s:
            return
        self._logged.pop(peer, None)
        self._logged[peer] = now
        while len(self._logged) > UNPARSABLE_PEERS:
            del self._logged[next(iter(self._logged))]
        text = str(exc.message).strip()
        log.warning("unparsable HTTP request", extra={"peer": peer, "kind": type(exc).__name__,
                                                      "error": text.splitlines()[0][:120] if text else ""})
