"""The client library's gRPC channels: the default target (`RTMEDIA_TARGET`, the CLI's
`--target` default too) and the options every channel gets, with the credentials' TLS and
token. Apart from the clients (rtmedia.clients.client) so that RealtimeSession opens its own
channel without importing them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import grpc
from rtmedia.clients.credentials import Credentials

DEFAULT_TARGET = os.environ.get("RTMEDIA_TARGET", "127.0.0.1:50051")  # the CLI's --target default too
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
]


def channel(target: str = DEFAULT_TARGET, credentials: Credentials | None = None,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A sync channel: the credentials' TLS and token, the client's options plus `options`."""
    return (credentials or Credentials()).channel(target, [*CHANNEL_OPTIONS, *options])


def aio_channel(target: str = DEFAULT_TARGET, credentials: Credentials | None = None,
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel, as `channel()` makes a sync one."""
    return (credentials or Credentials()).aio_channel(target, [*CHANNEL_OPTIONS, *options])
