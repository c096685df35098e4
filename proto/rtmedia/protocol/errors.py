"""gRPC errors with a stable machine-readable reason (google.rpc.ErrorInfo)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "rtmedia"
# What a status may carry, in UTF-8 bytes: its message, and each ErrorInfo metadata value. A status
# travels in the trailers, which a client refuses beyond its metadata limit (it then sees
# RESOURCE_EXHAUSTED instead, and not the status); messages quote what clients send (a voice
# name, a language), so they are cut here, whatever built them.
MAX_MESSAGE_BYTES = 1024
MAX_METADATA_BYTES = 256


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, marked with "..." where it was cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


def shown(value: str, limit: int = 64) -> str:
    """`value` as an error message quotes it: its repr, cut after `limit` characters."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def rich_status(code: grpc.StatusCode, reason: str, message: str, **metadata: str) -> grpc.Status:
    """A status whose details carry ErrorInfo(reason, domain, metadata); the message and the
    metadata values are clipped (MAX_MESSAGE_BYTES, MAX_METADATA_BYTES)."""
    message = clip(message, MAX_MESSAGE_BYTES)
    metadata = {key: clip(value, MAX_METADATA_BYTES) for key, value in metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[detail])
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, message: str,
                **metadata: str) -> None:
    """End the RPC with `code` and an ErrorInfo `reason`; never returns."""
    await context.abort_with_status(rich_status(code, reason, message, **metadata))
    raise AssertionError("unreachable: abort_with_status raises")


def error_reason(error: grpc.RpcError) -> str | None:
    """The ErrorInfo reason of a failed call, for clients and tests."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return None


def error_metadata(error: grpc.RpcError) -> dict[str, str]:
    """The ErrorInfo metadata of a failed call ({} when it has none)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return dict(info.metadata)
    return {}
