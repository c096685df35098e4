"""Errors of the OpenAI-compatible HTTP front in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}` with the HTTP status OpenAI uses, which the
official SDK turns into its exception classes (BadRequestError for 400, AuthenticationError
for 401, RateLimitError for 429, InternalServerError for 5xx, ...).

`from_rpc` maps the rtmedia server's gRPC statuses (google.rpc.ErrorInfo reasons,
docs/protocol.md) onto them: a client's mistake is a 4xx naming the field; the server's own
trouble is a 5xx; nothing a client sent is a 500.
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web
from rtmedia.clients.errors import RtmediaError
from rtmedia.protocol.errors import error_metadata, error_reason

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RETRY_AFTER_S = 5  # Retry-After of a 503 (warming up, draining): this replica soon, or another


class OpenAIError(Exception):
    """An answer in OpenAI's error shape; raise it from a handler (the front's middleware
    answers it). `param`: the request field at fault; `code`: a stable lower-case word."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def http_error(status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None
               ) -> web.Response:
    """aiohttp's and the web front's own refusals (401, 404, 405, 413, 503) in OpenAI's shape."""
    kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    if status == 401:
        code = code or "invalid_api_key"
    return OpenAIError(status, message, kind, None, code, headers).response()


# ErrorInfo reasons -> the request field they are about, where the server's reason names one.
_PARAMS = {
    "EMPTY_TEXT": "input", "TEXT_TOO_LONG": "input", "NOTHING_TO_SPEAK": "input",
    "UNKNOWN_VOICE": "voice", "UNSUPPORTED_SAMPLE_RATE": "sample_rate", "BAD_SPEED": "speed",
    "BAD_LANGUAGE": "language", "BAD_AUDIO": "file",
}
# ErrorInfo reasons -> OpenAI's code for the same refusal, where it has its own word.
_CODES = {"BAD_LANGUAGE": "unsupported_language"}


def from_rpc(exc: grpc.aio.AioRpcError | RtmediaError, params: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI error for a failed call to the rtmedia server. `params` adds or overrides
    reason -> field names for this endpoint."""
    if isinstance(exc, RtmediaError):
        code, reason, details, metadata = exc.code, exc.reason, exc.details, exc.metadata
    else:
        code, reason, details, metadata = exc.code(), error_reason(exc) or "", exc.details(), error_metadata(exc)
    detail = details or code.name
    param = {**_PARAMS, **(params or {})}.get(reason)
    word = _CODES.get(reason, reason.lower()) or None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return OpenAIError(400, detail, INVALID_REQUEST, param, word)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return OpenAIError(401, "invalid API key: send Authorization: Bearer TOKEN with one of the server's tokens",
                           INVALID_REQUEST, None, "invalid_api_key")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return OpenAIError(403, detail, INVALID_REQUEST, None, word)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason in ("QUOTA", "MAX_SESSIONS", "AT_CAPACITY"):
        retry = metadata.get("retry_after_s")
        headers = {"Retry-After": str(max(1, round(float(retry))))} if retry else {}
        return OpenAIError(429, detail, "requests", None, "rate_limit_exceeded", headers)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not reason:  # grpc's own message size limit
        return OpenAIError(413, f"the request is too large for the server: {detail}", INVALID_REQUEST, None,
                           "request_too_large")
    if code == grpc.StatusCode.UNAVAILABLE and reason:  # WARMING_UP, DRAINING, ENGINE_UNAVAILABLE, ...
        return OpenAIError(503, detail, SERVER_ERROR, None, word, {"Retry-After": str(RETRY_AFTER_S)})
    if code == grpc.StatusCode.UNAVAILABLE:
        return OpenAIError(502, f"cannot reach the rtmedia server: {detail}", SERVER_ERROR, None, "server_unreachable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, detail, SERVER_ERROR, None, word or "timeout")
    return OpenAIError(500 if reason else 502, detail, SERVER_ERROR, None, word or code.name.lower())
