"""The scheduler: the only owner of engines.

Each engine has a lane: a queue of work items, a batch policy (`max_batch`,
`max_wait_ms`), a priority class and a number of batches it may run at once.
A lane's runner tasks take batches off the queue and run `engine.step(batch)`
in the lane's worker threads, never on the event loop, then resolve each
item's future. Callers `await scheduler.submit(lane, item)`; a caller that is
cancelled takes its item out of the queue (or leaves its result unread if the
batch is already running).

Within a lane, items are taken in priority order (REALTIME > INTERACTIVE >
BULK), then by when they are due: an item submitted with `due` (a loop time,
e.g. when a client's audio runs out) sorts by it, any other item by its
arrival, so a lane without due items is first come, first served. Across lanes, a BULK lane starts a step only while no
REALTIME or INTERACTIVE lane has work waiting, so long bulk jobs (video
decode steps) run between realtime steps, never in front of them.

A lane with a `shard` function keeps one queue per runner and gives runner i
only the items whose shard is i: the ASR lane has one runner per recogniser
worker process, so a worker's slow step (a long turn's final) never holds up
the items of streams pinned to the other (and so has the `asr_final` lane of
turn ends, which a worker answers between two pieces of its current step).

A tick lane (`TickLane`) has no queue: every period it collects the work of
all live sessions on the loop, processes it in one batched step in its
thread, and hands the results back on the loop (the VAD lane).

The LM lane (`LmLane`, server/lm_lane.py) batches the decode steps of every
generating session on one model; a stream lane (`StreamLane`) runs streaming
calls that are not batched (a reply from an OpenAI-compatible server, the echo
responder) as tasks it owns, at most `concurrency` at once, in priority order.
All four kinds are lanes of this one scheduler: named by the server when it
registers them (engines do not know lane names), loaded, started and closed
together. Sessions and servicers reach them only through the typed handles of
server/engine_access.py.

An engine reports a per-item failure by returning an exception instance as
that item's result. When `step` raises for a batch, its items are stepped one
by one, so one bad item (say, of a stream its session just closed) fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, TypeVar

from rtmedia.engines.base import Engine, EngineError
from rtmedia.server.metrics import Metrics

if TYPE_CHECKING:
    from rtmedia.server.lm_lane import LmLane

log = logging.getLogger(__name__)
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


class Lane:
    """One engine's queue, batch policy and worker threads. `step` is what a batch runs
    (default: `engine.step`; the `asr_final` lane runs the recogniser's urgent step)."""

    def __init__(self, name: str, engine: Engine, policy: LanePolicy, scheduler: Scheduler,
                 step: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.engine = engine
        self.name = name
        self.policy = policy
        self.priority = policy.priority
        self._step = step or engine.step
        self._scheduler = scheduler
        self._metrics = scheduler.metrics
        # Heaps of [priority, due, seq, item, future], one per shard; withdrawn entries have future done.
        self._queues: list[list[list[Any]]] = [[] for _ in range(policy.concurrency if policy.shard else 1)]
        self._seq = 0
        self._ready = asyncio.Condition()
        # One thread per runner (a runner runs one step at a time), started with the lane.
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.name}-{i}")
                           for i in range(policy.concurrency)]
        self._runners: list[asyncio.Task[None]] = []

    @property
    def waiting(self) -> int:
        return sum(1 for queue in self._queues for entry in queue if not entry[4].done())

    def start(self) -> None:
        self._runners = []
        for i, executor in enumerate(self._executors):
            executor.submit(lambda: None)  # starts its thread now rather than at the first step
            self._runners.append(asyncio.create_task(self._run(self._queues[i % len(self._queues)], executor),
                                                     name=f"lane-{self.name}-{i}"))

    def _queue_of(self, item: Any) -> list[list[Any]]:
        shard = self.policy.shard
        return self._queues[shard(item) % len(self._queues)] if shard else self._queues[0]

    def _depth(self) -> None:
        self._metrics.lane_queue_depth.labels(self.name).set(sum(map(len, self._queues)))

    async def submit(self, item: Any, priority: Priority | None = None, due: float | None = None) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._seq += 1
        rank = self.policy.priority if priority is None else priority
        async with self._ready:
            heapq.heappush(self._queue_of(item), [rank, loop.time() if due is None else due, self._seq, item, future])
            self._depth()
            self._ready.notify_all()
        try:
            return await future
        finally:
            future.cancel()  # a no-op when resolved; withdraws the item when the caller was cancelled

    async def _next_batch(self, queue: list[list[Any]]) -> list[list[Any]]:
        async with self._ready:
            await self._ready.wait_for(lambda: bool(queue))
        if self.policy.priority is Priority.BULK:
            await self._scheduler.wait_realtime_idle()
        if self.policy.max_wait_ms and len(queue) < self.policy.max_batch:
            await asyncio.sleep(self.policy.max_wait_ms / 1000)
        batch = []
        while queue and len(batch) < self.policy.max_batch:
            entry = heapq.heappop(queue)
            if not entry[4].done():
                batch.append(entry)
        self._depth()
        return batch

    async def _run(self, queue: list[list[Any]], executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch(queue)
            if not batch:
                continue
            items = [entry[3] for entry in batch]
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(executor, self._step, items)
                if len(results) != len(items):
                    raise EngineError(f"{self.name}.step returned {len(results)} results for {len(items)} items")
            except Exception as exc:  # the batch failed: find out which items did, one by one
                self._metrics.lane_step_failures.labels(self.name).inc()
                log.exception("lane %s: step failed", self.name)
                results = [exc] if len(items) == 1 else [
                    await loop.run_in_executor(executor, self._step_one, item) for item in items
                ]
            self._metrics.lane_step_seconds.labels(self.name).observe(time.perf_counter() - started)
            self._metrics.lane_batch_size.labels(self.name).observe(len(items))
            for entry, result in zip(batch, results, strict=True):
                future = entry[4]
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            self._scheduler.lane_progressed()

    def _step_one(self, item: Any) -> Any:
        try:
            return self._step([item])[0]
        except Exception as exc:
            return exc

    async def close(self) -> None:
        await _cancel_all(self._runners)
        for queue in self._queues:
            for entry in queue:
                entry[4].cancel()
            queue.clear()
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)


class TickLane:
    """A lane that runs every `period_ms`: `collect()` on the loop gathers the work
    of every live session, `process(work)` runs it as one batched step in the
    lane's thread, `deliver(results)` hands the results back on the loop. A tick
    whose step outlasts the period counts a deadline miss."""

    def __init__(self, name: str, engine: Engine, period_ms: float, collect: Callable[[], Any],
                 process: Callable[[Any], Any], deliver: Callable[[Any], None], scheduler: Scheduler) -> None:
        self.engine = engine
        self.name = name
        self.period = period_ms / 1000
        self.priority = Priority.REALTIME
        self._collect, self._process, self._deliver = collect, process, deliver
        self._metrics = scheduler.metrics
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tick-{self.name}")
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0

    @property
    def waiting(self) -> int:
        return 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"tick-{self.name}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick += self.period
            work = self._collect()
            if work:
                started = time.perf_counter()
                try:  # a failed step or delivery costs one tick, never the lane
                    results = await loop.run_in_executor(self._executor, self._process, work)
                    self._deliver(results)
                except Exception:
                    self._metrics.lane_step_failures.labels(self.name).inc()
                    log.exception("tick lane %s: step failed", self.name)
                elapsed = time.perf_counter() - started
                self._metrics.lane_step_seconds.labels(self.name).observe(elapsed)
                self._metrics.lane_batch_size.labels(self.name).observe(len(work))
                if elapsed > self.period:
                    self._metrics.lane_deadline_misses.labels(self.name).inc()
            self.ticks += 1
            delay = next_tick - loop.time()
            if delay < 0:  # fell behind: skip the missed ticks rather than bursting
                next_tick = loop.time()
                delay = 0
            await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._task is not None:
            await _cancel_all([self._task])
        self._executor.shutdown(wait=True, cancel_futures=True)


class StreamLane:
    """Streaming calls that are not batched (a reply from an HTTP server): each runs as a
    task the lane owns and names, at most `policy.concurrency` at once, admitted in priority
    order then first come, first served. The task hands what the call yields to its caller
    through a bounded queue (the call waits when the caller is behind); a caller that goes
    away cancels its call, and closing the lane cancels them all."""

    QUEUE = 64  # items a call may run ahead of its caller

    def __init__(self, name: str, policy: LanePolicy, scheduler: Scheduler) -> None:
        self.name = name
        self.engine = None
        self.policy = policy
        self.priority = policy.priority
        self._metrics = scheduler.metrics
        self._free = policy.concurrency
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of (priority, seq, admission)
        self._seq = 0
        self._calls: set[asyncio.Task[None]] = set()

    @property
    def waiting(self) -> int:
        return sum(1 for *_, admission in self._queue if not admission.done())

    def start(self) -> None:
        pass

    async def _admit(self, priority: Priority) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._queue, (priority, self._seq, admission))
        self._metrics.lane_queue_depth.labels(self.name).set(self.waiting)
        try:
            await admission
        except asyncio.CancelledError:
            if admission.done() and not admission.cancelled():
                self._release()  # admitted as it was cancelled: pass the place on
            raise

    def _release(self) -> None:
        while self._queue:
            *_, admission = heapq.heappop(self._queue)
            if not admission.done():
                admission.set_result(None)
                break
        else:
            self._free += 1
        self._metrics.lane_queue_depth.labels(self.name).set(self.waiting)

    async def stream(self, call: Callable[[], AsyncIterator[T]], priority: Priority | None = None
                     ) -> AsyncIterator[T]:
        """Run `call()` in the lane and yield what it yields; its exception is raised here."""
        await self._admit(self.policy.priority if priority is None else priority)
        out: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue(self.QUEUE)

        async def run() -> None:
            started = time.perf_counter()
            try:
                async for value in call():
                    await out.put((True, value))
                await out.put((False, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._metrics.lane_step_failures.labels(self.name).inc()
                await out.put((False, exc))
            finally:
                self._metrics.lane_step_seconds.labels(self.name).observe(time.perf_counter() - started)

        task = asyncio.create_task(run(), name=f"lane-{self.name}-{self._seq}")
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        try:
            while True:
                more, value = await out.get()
                if not more:
                    if value is not None:
                        raise value
                    return
                yield value
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._release()

    async def close(self) -> None:
        await _cancel_all(list(self._calls))
        for *_, admission in self._queue:
            admission.cancel()
        self._queue.clear()


async def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Scheduler:
    """Owns the engines and their lanes: every lane is registered here by name, loaded,
    started and closed here, and nothing else calls an engine."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.lanes: dict[str, Lane | TickLane | LmLane | StreamLane] = {}
        self._progress = asyncio.Event()

    def _register(self, lane: Any) -> Any:
        if lane.name in self.lanes:
            raise ValueError(f"a lane named {lane.name!r} is registered already")
        self.lanes[lane.name] = lane
        return lane

    def add(self, name: str, engine: Engine, policy: LanePolicy,
            step: Callable[[list[Any]], list[Any]] | None = None) -> Lane:
        """A batching lane of `engine` (its `step`, or the given one)."""
        lane: Lane = self._register(Lane(name, engine, policy, self, step))
        return lane

    def add_tick(self, name: str, engine: Engine, period_ms: float, collect: Callable[[], Any],
                 process: Callable[[Any], Any], deliver: Callable[[Any], None]) -> TickLane:
        """A lane that runs every `period_ms` over the work `collect()` gathers (see TickLane)."""
        lane: TickLane = self._register(TickLane(name, engine, period_ms, collect, process, deliver, self))
        return lane

    def add_lm(self, name: str, engine: Any) -> LmLane:
        """The continuous-batching lane of one LM engine (server/lm_lane.py)."""
        from rtmedia.server.lm_lane import LmLane

        lane: LmLane = self._register(LmLane(name, engine, self.metrics))
        return lane

    def add_stream(self, name: str, policy: LanePolicy) -> StreamLane:
        """A lane of unbatched streaming calls (see StreamLane)."""
        lane: StreamLane = self._register(StreamLane(name, policy, self))
        return lane

    def lane(self, name: str) -> Lane:
        """The batching lane `name` (for what runs `submit` on it)."""
        lane = self.lanes[name]
        if not isinstance(lane, Lane):
            raise TypeError(f"lane {name!r} is a {type(lane).__name__}, not a batching lane")
        return lane

    def _engines(self) -> list[Any]:
        """Each lane's engine once (two lanes may share one: asr and asr_final)."""
        engines: list[Any] = []
        for lane in self.lanes.values():
            if lane.engine is not None and all(lane.engine is not e for e in engines):
                engines.append(lane.engine)
        return engines

    def lane_progressed(self) -> None:
        self._progress.set()

    async def wait_realtime_idle(self) -> None:
        """Return once no REALTIME or INTERACTIVE lane has queued work."""
        while any(lane.waiting for lane in self.lanes.values()
                  if isinstance(lane, Lane) and lane.priority < Priority.BULK):
            self._progress.clear()
            await self._progress.wait()

    async def load(self) -> None:
        """Load and warm up every engine, off the event loop."""
        for engine in self._engines():
            started = time.perf_counter()
            await asyncio.to_thread(engine.load)
            await asyncio.to_thread(engine.warmup)
            log.info("engine %s ready in %.2f s", engine.name, time.perf_counter() - started)

    def start(self) -> None:
        for lane in self.lanes.values():
            lane.start()

    async def submit(self, lane: str, item: Any, priority: Priority | None = None,
                     due: float | None = None) -> Any:
        return await self.lane(lane).submit(item, priority, due)

    async def close(self) -> None:
        for lane in self.lanes.values():
            await lane.close()
        for engine in self._engines():
            await asyncio.to_thread(engine.close)
