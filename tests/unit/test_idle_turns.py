"""The idle-turn timer (turn_detection.idle_timeout_ms, docs/protocol.md#idle-turns): it fires once the
session has been quiet for the timeout, never while it is not quiet, and waits longer when the quiet
turns out to have begun later (an ack moved the end of playback)."""

from __future__ import annotations

import asyncio
import time

from rtmedia.server.session.idle_turns import IdleTimer


class Quiet:
    def __init__(self, since: float | None, timeout_ms: int | None = 50) -> None:
        self.since, self.timeout_ms = since, timeout_ms
        self.fired: list[tuple[float, float]] = []  # (since, when)
        self.event = asyncio.Event()

    def timer(self) -> IdleTimer:
        return IdleTimer(lambda: self.since, lambda: self.timeout_ms, self._expired)

    def _expired(self, since: float) -> None:
        self.fired.append((since, time.perf_counter()))
        self.event.set()


async def until_fired(quiet: Quiet, timeout: float = 2.0) -> None:
    await asyncio.wait_for(quiet.event.wait(), timeout)


async def test_fires_after_the_timeout_from_when_the_quiet_began():
    quiet = Quiet(time.perf_counter())
    timer = quiet.timer()
    timer.arm()
    assert timer.armed
    await until_fired(quiet)
    assert len(quiet.fired) == 1 and not timer.armed
    since, when = quiet.fired[0]
    assert since == quiet.since and when - since >= 0.049


async def test_a_quiet_that_began_in_the_past_fires_at_once():
    quiet = Quiet(time.perf_counter() - 10)
    quiet.timer().arm()
    await until_fired(quiet)
    assert len(quiet.fired) == 1


async def test_not_quiet_or_off_never_fires_and_cancel_stops_it():
    for quiet in (Quiet(None), Quiet(time.perf_counter(), timeout_ms=None)):
        timer = quiet.timer()
        timer.arm()
        assert not timer.armed
    quiet = Quiet(time.perf_counter())
    timer = quiet.timer()
    timer.arm()
    timer.cancel()
    await asyncio.sleep(0.1)
    assert not quiet.fired


async def test_speech_meanwhile_stops_it_at_expiry():
    quiet = Quiet(time.perf_counter())
    quiet.timer().arm()
    quiet.since = None  # a turn started; nobody re-armed
    await asyncio.sleep(0.1)
    assert not quiet.fired


async def test_a_later_start_of_the_quiet_re_arms():
    start = time.perf_counter()
    quiet = Quiet(start)
    quiet.timer().arm()
    await asyncio.sleep(0.02)
    quiet.since = start + 0.3  # an ack: playback ends later than estimated
    await asyncio.sleep(0.1)
    assert not quiet.fired
    await until_fired(quiet)
    assert len(quiet.fired) == 1 and quiet.fired[0][1] - start >= 0.349
