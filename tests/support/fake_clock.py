"""A clock a test moves itself (server/lanes/clock.py's `Clock`): `await clock.advance(ms)`
runs every timer and sleep due within those milliseconds, in order, letting the event loop
settle between them, so a session's timers run in no wall time at all."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

SETTLE_ROUNDS = 20  # loop iterations given to what a fired timer started, before the next


class FakeTimer:
    def __init__(self, due: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.due, self.callback, self.args = due, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    def call_later(self, seconds: float, callback: Callable[..., Any], *args: Any) -> FakeTimer:
        timer = FakeTimer(self.t + max(0.0, seconds), callback, args)
        heapq.heappush(self._timers, (timer.due, next(self._seq), timer))
        return timer

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        woken = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, lambda: woken.done() or woken.set_result(None))
        try:
            await woken
        finally:
            timer.cancel()

    async def wait(self, awaitable: Awaitable[Any], seconds: float) -> bool:
        future = asyncio.ensure_future(awaitable)
        timeout = asyncio.ensure_future(self.sleep(seconds))
        try:
            await asyncio.wait([future, timeout], return_when=asyncio.FIRST_COMPLETED)
        finally:
            timeout.cancel()
        return future.done()

    @property
    def pending(self) -> int:
        """Timers not yet fired nor cancelled."""
        return sum(not t.cancelled for _, _, t in self._timers)

    async def settle(self) -> None:
        """Let the loop run what is ready (tasks woken by a timer, and what they start)."""
        for _ in range(SETTLE_ROUNDS):
            await asyncio.sleep(0)

    async def advance(self, ms: float) -> None:
        """Move the clock `ms` forward, firing each timer due on the way at its own time."""
        end = self.t + ms / 1000
        await self.settle()
        while self._timers and self._timers[0][0] <= end:
            due, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.t = max(self.t, due)
            timer.callback(*timer.args)
            await self.settle()
        self.t = end
        await self.settle()
