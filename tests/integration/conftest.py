"""An in-process rtmedia server per test module, with the real embedded engines.

Modules answer with the echo responder and skip loading the LM unless they set
`SERVER_OPTIONS` (ServerConfig fields) themselves."""

from __future__ import annotations

import grpc
import pytest
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig


@pytest.fixture(scope="module")
async def server(request):
    options = {"max_sessions": 64, "llm": False, "default_responder": "echo",
               **getattr(request.module, "SERVER_OPTIONS", {})}
    srv = RtmediaServer(ServerConfig(port=0, metrics_port=0, grace_s=1, **options))
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.fixture(scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch
