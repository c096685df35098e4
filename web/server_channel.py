"""The web front's way to the rtmedia server: the gRPC channel (TLS and a client certificate
as `BridgeConfig` says) and the W3C trace context a request's calls carry, so the server's
trace of a call continues the client's."""

from __future__ import annotations

import re

import grpc
from aiohttp import web
from rtmedia.clients.channels import CHANNEL_OPTIONS
from rtmedia.clients.credentials import read_pem
from rtmedia.web.bridge_config import BridgeConfig

TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
MAX_TRACESTATE = 512


def trace_context(request: web.Request | None) -> tuple[tuple[str, str], ...]:
    """The request's W3C `traceparent` (and `tracestate`) headers as gRPC metadata, when well formed."""
    parent = request.headers.get("traceparent", "").strip() if request is not None else ""
    if not TRACEPARENT.fullmatch(parent):
        return ()
    assert request is not None
    state = request.headers.get("tracestate", "").strip()
    keep = 0 < len(state) <= MAX_TRACESTATE and all(" " <= c <= "~" for c in state)
    return (("traceparent", parent), *((("tracestate", state),) if keep else ()))


def server_channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def server_credentials(config: BridgeConfig) -> grpc.ChannelCredentials | None:
    """The channel credentials toward the server (files read now, so a bad one fails at start);
    None: plaintext."""
    if not config.server_tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=read_pem("--server-ca", config.server_ca, b"CERTIFICATE"),
                                        private_key=read_pem("--server-key", config.server_key, b"PRIVATE KEY"),
                                        certificate_chain=read_pem("--server-cert", config.server_cert, b"CERTIFICATE"))
