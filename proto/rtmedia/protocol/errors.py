"""gRPC errors with a stable machine-readable reason (google.rpc.ErrorInfo)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "rtmedia"


def rich_status(code: grpc.StatusCode, reason: str, message: str, **metadata: str) -> grpc.Status:
    """A status whose details carry ErrorInfo(reason, domain, metadata)."""
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
