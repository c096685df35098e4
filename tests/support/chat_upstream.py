"""A stand-in OpenAI-compatible chat-completions server for the `openai` responder's tests and
benchmarks: the one fake at the edge (the upstream LM). It streams what `script(body)`
returns for each request (text, and function calls split into several argument deltas) and
keeps every request body (and its headers) it got.

A step of a script is a string (one content delta) or a `Calls` (tool calls, each streamed
as its name and then its arguments in `pieces` parts), optionally after `delay_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.serve import free_port


@dataclass
class Calls:
    calls: list[tuple[str, dict[str, Any]]]  # (function, arguments)
    pieces: int = 3


@dataclass
class ChatUpstream:
    script: Callable[[dict[str, Any]], list[str | Calls]]
    delay_s: float = 0.0  # before the first chunk
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # each request's headers, beside its body
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> ChatUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[ChatUpstream]:
        """Served from a thread of its own (for tests that are not async)."""
        loop = asyncio.new_event_loop()
        started, stop = threading.Event(), asyncio.Event()

        async def serve() -> None:
            async with self:
                started.set()
                await stop.wait()

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        started.wait(10)
        try:
            yield self
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(10)
            loop.close()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        finish = "stop"
        for step in self.script(body):
            if isinstance(step, str):
                await self._chunk(response, {"content": step})
                continue
            finish = "tool_calls"
            for index, (name, arguments) in enumerate(step.calls):
                text = json.dumps(arguments)
                size = max(1, -(-len(text) // step.pieces))
                await self._chunk(response, {"tool_calls": [{"index": index, "id": f"up_{index}", "type": "function",
                                                             "function": {"name": name, "arguments": ""}}]})
                for start in range(0, len(text), size):
                    await self._chunk(response, {"tool_calls": [{"index": index,
                                                                 "function": {"arguments": text[start:start + size]}}]})
        await self._chunk(response, {}, finish)
        await response.write(b"data: [DONE]\n\n")
        return response

    @staticmethod
    async def _chunk(response: web.StreamResponse, delta: dict[str, Any], finish: str | None = None) -> None:
        chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())


def tool_results(body: dict[str, Any]) -> list[str]:
    """The tool messages' contents of a request body, in order."""
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]
