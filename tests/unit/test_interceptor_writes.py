"""The interceptor ends a duplex call whose servicer was writing when an undecodable request
came: grpc's core refuses a status while a cancelled write is still being sent
(GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), which left the call open for good."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import CollectorRegistry
from rtmedia.protocol.errors import error_reason
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.security.interceptors import ServerInterceptor
from rtmedia.v1 import common_pb2

BIG = 8 * 1024 * 1024  # far over HTTP/2's flow-control window: the write waits for the client to read
METHOD = "/rtmedia.test.Duplex/Talk"


async def talk(request_iterator, context):
    """Reads its requests in a task of its own while it writes a large message, as Converse does."""
    reader = asyncio.ensure_future(_drain(request_iterator))
    try:
        await context.write(common_pb2.AudioFormat(sample_rate=16000).SerializeToString() + bytes(BIG))
        await reader
    finally:
        reader.cancel()


async def _drain(iterator) -> None:
    async for _ in iterator:
        pass


@pytest.fixture
async def duplex_server():
    handler = grpc.stream_stream_rpc_method_handler(talk, request_deserializer=common_pb2.AudioFormat.FromString)
    server = grpc.aio.server(interceptors=[ServerInterceptor(Metrics(CollectorRegistry()), lambda: None)],
                             options=[("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("rtmedia.test.Duplex", {"Talk": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(0)


async def test_an_undecodable_request_ends_a_call_whose_write_is_under_way(duplex_server, caplog):
    caplog.set_level(logging.ERROR)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{duplex_server}",
                                         options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.stream_stream(METHOD)(iter([b"\xff\xff\xff"]))
        await asyncio.sleep(0.5)  # the servicer is cancelled mid-write; the client reads only now
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                async for _ in call:
                    pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(info.value) == "UNDECODABLE_REQUEST"
    assert not [r for r in caplog.records if "ExecuteBatchError" in r.getMessage()]


async def test_a_write_the_cancelled_servicer_left_fails_quietly(duplex_server, caplog):
    """A client that goes away while a write is held: the write fails in grpc's core, with no
    servicer awaiting it any more, and nothing is logged for it."""
    import gc

    caplog.set_level(logging.ERROR)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{duplex_server}") as channel:
        call = channel.stream_stream(METHOD)(iter([b"\xff\xff\xff"]))
        await asyncio.sleep(0.3)
        call.cancel()
    await asyncio.sleep(0.5)
    gc.collect()
    await asyncio.sleep(0.1)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.records
