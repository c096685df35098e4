"""A Converse stream for tests: send canonical events, stream audio, wait for events."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from rtmedia.protocol.events import client_event, to_json
from rtmedia.v1 import realtime_pb2_grpc

_CLOSE = object()


class Conversation:
    """Events received are kept as canonical JSON dicts with `t` (seconds since open)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple = ()) -> None:
        self._stub = realtime_pb2_grpc.RealtimeServiceStub(channel)
        self._metadata = metadata
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self.events: list[dict[str, Any]] = []
        self._arrived = asyncio.Condition()
        self.t0 = time.perf_counter()
        self.call: Any = None
        self.error: grpc.aio.AioRpcError | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Conversation:
        self.call = self._stub.Converse(self._requests_iter(), metadata=self._metadata)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    @property
    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _requests_iter(self):
        while (request := await self._requests.get()) is not _CLOSE:
            yield request

    async def _read(self) -> None:
        try:
            async for event in self.call:
                data = to_json(event)
                data["t"] = self.now
                async with self._arrived:
                    self.events.append(data)
                    self._arrived.notify_all()
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        finally:
            async with self._arrived:
                self.events.append({"type": "<end>", "t": self.now})
                self._arrived.notify_all()

    def send(self, name: str, **fields: Any) -> None:
        self._requests.put_nowait(client_event(name, **fields))

    def end_requests(self) -> None:
        self._requests.put_nowait(_CLOSE)

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    async def stream(self, pcm: bytes, rate: int, chunk_ms: int = 20, speed: float = 1.0,
                     bytes_per_sample: int = 2) -> float:
        """Send audio in chunks, paced at `speed` times real time; returns when it started."""
        step = rate * chunk_ms // 1000 * bytes_per_sample
        started = self.now
        for n, offset in enumerate(range(0, len(pcm), step)):
            self.send("input_audio_buffer.append", audio=pcm[offset:offset + step])
            due = started + (n + 1) * chunk_ms / 1000 / speed
            await asyncio.sleep(max(0.0, due - self.now))
        return started

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def wait_for(self, kind: str, timeout: float = 15.0, count: int = 1, **match: Any) -> dict[str, Any]:
        """The `count`-th event of `kind` whose fields match; fails on timeout or stream end."""

        def found() -> dict[str, Any] | None:
            hits = [e for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in match.items())]
            if len(hits) >= count:
                return hits[count - 1]
            if self.events and self.events[-1]["type"] == "<end>":
                raise AssertionError(f"stream ended before {kind} {match}; got {self.types()}; error {self.error}")
            return None

        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: found() is not None), timeout)
            except TimeoutError:
                raise AssertionError(f"no {kind} {match} within {timeout} s; got {self.types()}") from None
            result = found()
            assert result is not None
            return result

    async def ended(self, timeout: float = 15.0) -> None:
        await self.wait_for("<end>", timeout)
