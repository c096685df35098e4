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
    # Two fast-final decoders per ASR worker (the default, 10, is sized for a server's many
    # concurrent turns; a module here ends a few at once, and one past the pool is built on
    # demand): each is a quarter second of a start's CPU.
    options = {"max_sessions": 64, "llm": False, "default_responder": "echo", "grace_s": 1, "asr_decoders": 2,
               **getattr(request.module, "SERVER_OPTIONS", {})}
    srv = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, **options))
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.fixture(scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
async def web_front(server, request):
    """The web front (rtmedia.web.bridge, with OpenAI's audio APIs) beside the module's server;
    modules may set `WEB_OPTIONS` (BridgeConfig fields)."""
    from rtmedia.web.bridge import Bridge, BridgeConfig

    bridge = Bridge(BridgeConfig(target=f"127.0.0.1:{server.port}", port=0,
                                 **getattr(request.module, "WEB_OPTIONS", {})))
    await bridge.start()
    yield bridge
    await bridge.stop()


@pytest.fixture(scope="module")
async def openai_client(web_front):
    """The official SDK's async client on the web front (no retries: a test sees each answer)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{web_front.port}/v1", api_key="rtmedia-test",
                                  max_retries=0) as client:
        yield client
