"""Server errors as typed exceptions: the gRPC status, its ErrorInfo reason and metadata.

Every call of the client library raises `RtmediaError` (or the subclass for its status) instead
of a bare `grpc.RpcError`, so a program tests `err.reason == "UNSUPPORTED_SAMPLE_RATE"` and
catches `Unavailable` to retry, without unpacking status details itself.
"""

from __future__ import annotations

import grpc
from rtmedia.protocol.errors import error_metadata, error_reason


class RtmediaError(Exception):
    """A call the server (or the channel) ended with a non-OK status.

    `code`: the gRPC status; `reason`: the ErrorInfo reason (docs/protocol.md#errors), "" when the
    status carried none (e.g. a channel that never connected); `details`: the status message;
    `metadata`: the ErrorInfo metadata (e.g. `retry_after_s`).
    """

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "",
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(f"{code.name}: {details}" + (f" ({reason})" if reason else ""))
        self.code, self.details, self.reason = code, details, reason
        self.metadata = metadata or {}

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> RtmediaError:
        """The typed exception of a failed gRPC call."""
        code = error.code()  # type: ignore[attr-defined]
        kind = _BY_CODE.get(code, RtmediaError)
        return kind(code, error.details() or "", error_reason(error) or "",  # type: ignore[attr-defined]
                    error_metadata(error))


class InvalidArgument(RtmediaError):
    """The request was malformed or out of range (INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION)."""


class NotFound(RtmediaError):
    """An unknown voice, model or item (NOT_FOUND)."""


class Refused(RtmediaError):
    """Admission or a quota refused the call (RESOURCE_EXHAUSTED: AT_CAPACITY, MAX_SESSIONS, QUOTA, ...)."""


class Unauthenticated(RtmediaError):
    """No token, or one the server does not accept (UNAUTHENTICATED)."""


class PermissionDenied(RtmediaError):
    """The token may not use this (PERMISSION_DENIED)."""


class Unavailable(RtmediaError):
    """The server could not be reached, or is draining (UNAVAILABLE); worth retrying elsewhere."""


class DeadlineExceeded(RtmediaError):
    """The call's timeout passed (DEADLINE_EXCEEDED)."""


class Cancelled(RtmediaError):
    """The call was cancelled (CANCELLED)."""


_S = grpc.StatusCode
_BY_CODE: dict[grpc.StatusCode, type[RtmediaError]] = {
    _S.INVALID_ARGUMENT: InvalidArgument, _S.OUT_OF_RANGE: InvalidArgument, _S.FAILED_PRECONDITION: InvalidArgument,
    _S.NOT_FOUND: NotFound, _S.RESOURCE_EXHAUSTED: Refused, _S.UNAUTHENTICATED: Unauthenticated,
    _S.PERMISSION_DENIED: PermissionDenied, _S.UNAVAILABLE: Unavailable, _S.DEADLINE_EXCEEDED: DeadlineExceeded,
    _S.CANCELLED: Cancelled,
}
