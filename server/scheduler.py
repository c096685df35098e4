"""The scheduler: the only owner of engines.

Each engine has a lane: a queue of work items, a batch policy (`max_batch`,
`max_wait_ms`) and a number of batches it may run at once. A lane's runner
tasks take batches off the queue and run `engine.step(batch)` in the lane's
worker threads, never on the event loop, then resolve each item's future.
Callers `await scheduler.submit(lane, item)`; a caller that is cancelled
takes its item out of the queue (or leaves its result unread if the batch is
already running).

An engine reports a per-item failure by returning an exception instance as
that item's result; an exception from `step` fails the whole batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rtmedia.engines.base import Engine, EngineError
from rtmedia.server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LanePolicy:
    max_batch: int = 16
    # Wait this long for more items once one is queued (0: take what is there).
    max_wait_ms: float = 0.0
    # Batches that may run at once (each in its own worker thread).
    concurrency: int = 1


class Lane:
    """One engine's queue, batch policy and worker threads."""

    def __init__(self, engine: Engine, policy: LanePolicy, metrics: Metrics) -> None:
        self.engine = engine
        self.name = engine.name
        self.policy = policy
        self._metrics = metrics
        self._queue: deque[tuple[Any, asyncio.Future[Any]]] = deque()
        self._ready = asyncio.Condition()
        self._executor = ThreadPoolExecutor(policy.concurrency, thread_name_prefix=f"engine-{self.name}")
        self._runners: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._runners = [
            asyncio.create_task(self._run(), name=f"lane-{self.name}-{i}") for i in range(self.policy.concurrency)
        ]

    async def submit(self, item: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        entry = (item, future)
        async with self._ready:
            self._queue.append(entry)
            self._metrics.lane_queue_depth.labels(self.name).set(len(self._queue))
            self._ready.notify()
        try:
            return await future
        finally:
            if not future.done():  # the caller was cancelled: withdraw the item
                future.cancel()
                with contextlib.suppress(ValueError):
                    self._queue.remove(entry)

    async def _next_batch(self) -> list[tuple[Any, asyncio.Future[Any]]]:
        async with self._ready:
            await self._ready.wait_for(lambda: bool(self._queue))
        if self.policy.max_wait_ms and len(self._queue) < self.policy.max_batch:
            await asyncio.sleep(self.policy.max_wait_ms / 1000)
        batch = []
        while self._queue and len(batch) < self.policy.max_batch:
            entry = self._queue.popleft()
            if not entry[1].done():
                batch.append(entry)
        self._metrics.lane_queue_depth.labels(self.name).set(len(self._queue))
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if not batch:
                continue
            items = [item for item, _ in batch]
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self.engine.step, items)
                if len(results) != len(items):
                    raise EngineError(f"{self.name}.step returned {len(results)} results for {len(items)} items")
            except Exception as exc:  # the whole batch failed
                self._metrics.lane_step_failures.labels(self.name).inc()
                log.exception("lane %s: step failed", self.name)
                results = [exc] * len(items)
            self._metrics.lane_step_seconds.labels(self.name).observe(time.perf_counter() - started)
            self._metrics.lane_batch_size.labels(self.name).observe(len(items))
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def close(self) -> None:
        for task in self._runners:
            task.cancel()
        for task in self._runners:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _, future in self._queue:
            future.cancel()
        self._queue.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)


class Scheduler:
    """Owns the engines and their lanes."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.lanes: dict[str, Lane] = {}

    def add(self, engine: Engine, policy: LanePolicy) -> Lane:
        lane = Lane(engine, policy, self.metrics)
        self.lanes[lane.name] = lane
        return lane

    def engine(self, name: str) -> Any:
        return self.lanes[name].engine

    async def load(self) -> None:
        """Load and warm up every engine, off the event loop."""
        for lane in self.lanes.values():
            started = time.perf_counter()
            await asyncio.to_thread(lane.engine.load)
            await asyncio.to_thread(lane.engine.warmup)
            log.info("engine %s ready in %.2f s", lane.name, time.perf_counter() - started)

    def start(self) -> None:
        for lane in self.lanes.values():
            lane.start()

    async def submit(self, lane: str, item: Any) -> Any:
        return await self.lanes[lane].submit(item)

    async def close(self) -> None:
        for lane in self.lanes.values():
            await lane.close()
            await asyncio.to_thread(lane.engine.close)
