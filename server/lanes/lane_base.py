"""What every lane shares, whichever kind: the priority classes, a batch lane's policy, the
account of a lane's faults its health watch reads, and the wait on one step with its deadline.

They live apart from the scheduler so that the lane kinds kept in their own modules (the LM
lane, server/lanes/lm_lane.py) use them without importing the scheduler that registers them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")


class Priority(IntEnum):
    REALTIME = 0
    INTERACTIVE = 1
    BULK = 2


@dataclass(frozen=True)
class LanePolicy:
    priority: Priority = Priority.INTERACTIVE
    max_batch: int = 16
    # Wait this long for more items once one is queued (0: take what is there).
    max_wait_ms: float = 0.0
    # Batches that may run at once (each in its own worker thread).
    concurrency: int = 1
    # With a shard function, runner i takes only the items whose shard(item) % concurrency is i
    # (an engine whose items are pinned to separate workers: no runner waits on another's).
    shard: Callable[[Any], int] | None = None
    # The longest one step may run, in seconds (None: no limit): a step past it fails its items
    # at the deadline, and its runner takes no other step until it returns (module docstring).
    step_deadline_s: float | None = None


class LaneHealth:
    """One lane's own account of its faults, read by the scheduler's health watch: which of
    its runners have a step running past its deadline (since when), and the current run of
    failed steps. Written and read on the event loop only."""

    FAILED_STEPS = 3  # a run of failed steps at least this long before it can make a lane unhealthy

    def __init__(self) -> None:
        self.hung: dict[int, float] = {}  # runner -> monotonic time its step passed its deadline
        self.failures = 0  # failed steps since the last one that succeeded
        self._failing_since = 0.0
        self._last_failure = 0.0

    def step_done(self, ok: bool) -> None:
        if ok:
            self.failures = 0
            return
        now = time.monotonic()
        if not self.failures:
            self._failing_since = now
        self.failures += 1
        self._last_failure = now

    def problem(self, now: float, after: float) -> str | None:
        """Why the lane is unhealthy at `now` (monotonic), or None."""
        if self.hung and (late := now - min(self.hung.values())) >= after:
            return f"a step has run {late:.1f} s past its deadline and has not returned"
        if self.failures >= self.FAILED_STEPS and now - self._failing_since >= after \
                and now - self._last_failure < after:
            return f"its last {self.failures} steps failed, over {now - self._failing_since:.1f} s"
        return None


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Done callback of a step that ran past its deadline: its outcome is nobody's, but is read."""
    if not future.cancelled():
        future.exception()


async def wait_step(future: asyncio.Future[T], deadline: float | None, on_late: Callable[[], BaseException]) -> T:
    """The step's result, or, once `deadline` seconds pass without one, `on_late()` raised (the step
    goes on in its thread; its outcome is read and dropped when it comes)."""
    if deadline is None:
        return await future
    done, _ = await asyncio.wait({future}, timeout=deadline)
    if done:
        return future.result()
    future.add_done_callback(_retrieve)
    raise on_late()
