"""The OpenAI front's error mapping (rtmedia.web.openai.openai_errors): the server's gRPC statuses and
the web port's own refusals in OpenAI's shape and HTTP statuses."""

from __future__ import annotations

import json

import grpc
import pytest
from rtmedia.protocol.errors import rich_status
from rtmedia.web.openai.openai_errors import from_rpc, http_error


def rpc_error(code: grpc.StatusCode, reason: str = "", message: str = "it went wrong", **metadata: str):
    if not reason:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)
    status = rich_status(code, reason, message, **metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
                                details=status.details)


@pytest.mark.parametrize("code, reason, status, kind, param, word", [
    (grpc.StatusCode.INVALID_ARGUMENT, "TEXT_TOO_LONG", 400, "invalid_request_error", "input", "text_too_long"),
    (grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_VOICE", 400, "invalid_request_error", "voice", "unknown_voice"),
    (grpc.StatusCode.INVALID_ARGUMENT, "BAD_SPEED", 400, "invalid_request_error", "speed", "bad_speed"),
    (grpc.StatusCode.INVALID_ARGUMENT, "BAD_LANGUAGE", 400, "invalid_request_error", "language",
     "unsupported_language"),
    (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", 401, "invalid_request_error", None, "invalid_api_key"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA", 429, "requests", None, "rate_limit_exceeded"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "OUT_OF_MEMORY", 500, "server_error", None, "out_of_memory"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "", 413, "invalid_request_error", None, "request_too_large"),
    (grpc.StatusCode.UNAVAILABLE, "WARMING_UP", 503, "server_error", None, "warming_up"),
    (grpc.StatusCode.UNAVAILABLE, "DRAINING", 503, "server_error", None, "draining"),
    (grpc.StatusCode.UNAVAILABLE, "", 502, "server_error", None, "server_unreachable"),
    (grpc.StatusCode.INTERNAL, "ENGINE_FAILED", 500, "server_error", None, "engine_failed"),
    (grpc.StatusCode.UNKNOWN, "", 502, "server_error", None, "unknown"),
])
def test_server_statuses_map_to_openai_errors(code, reason, status, kind, param, word):
    error = from_rpc(rpc_error(code, reason))
    assert (error.status, error.type, error.param, error.code) == (status, kind, param, word)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if status == 503:
        assert error.headers["Retry-After"]


def test_a_quota_carries_its_retry_after():
    error = from_rpc(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA", "over", retry_after_s="2.5"))
    assert error.status == 429 and error.headers == {"Retry-After": "2"}


def test_an_endpoint_names_its_own_fields():
    error = from_rpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "BAD_AUDIO"), {"BAD_AUDIO": "audio"})
    assert error.param == "audio"


@pytest.mark.parametrize("status, kind, word", [(401, "invalid_request_error", "invalid_api_key"),
                                                (404, "invalid_request_error", None), (503, "server_error", None)])
def test_the_web_ports_refusals_are_in_openai_shape(status, kind, word):
    response = http_error(status, "no")
    body = json.loads(response.body)["error"]
    assert response.status == status and body == {"message": "no", "type": kind, "param": None, "code": word}
