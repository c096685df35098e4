"""The clock the ticks and the sessions read and wait on: the system's, or a test's.

A tick lane (server/lanes/scheduler.py) keeps its period on its `Clock`, and every timer of a
session goes through the session's (`SessionContext.clock`): the turn timers
(the confirmed interruption's `false_interruption_timeout_ms`, the wait for an early final),
the idle-turn timer, the tool-call filler and timeout, the reply's pacing at the client's
playback rate, and the timestamps that say how much of a reply was heard (`now`). The
system clock is `time.perf_counter` and the event loop's timers; a unit test gives the
session a clock it moves itself (tests/support/fake_clock.py), so a barge-in, a backchannel or
an idle timeout runs in milliseconds without a sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """What a session asks of time: `now()` in seconds (a perf_counter reading: only differences
    mean anything), a sleep, a callback after a delay, and a bounded wait."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, seconds: float, callback: Callable[..., Any], *args: Any) -> Timer: ...

    async def wait(self, awaitable: Awaitable[Any], seconds: float) -> bool:
        """Wait for `awaitable` (not cancelled at the timeout: shield it if it is shared) for at
        most `seconds`; whether it finished in time."""
        ...


class SystemClock:
    """The wall clock: `time.perf_counter` and the running loop's timers."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, seconds: float, callback: Callable[..., Any], *args: Any) -> Timer:
        return asyncio.get_running_loop().call_later(seconds, callback, *args)

    async def wait(self, awaitable: Awaitable[Any], seconds: float) -> bool:
        done, _ = await asyncio.wait([asyncio.ensure_future(awaitable)], timeout=seconds)
        return bool(done)


SYSTEM_CLOCK = SystemClock()
