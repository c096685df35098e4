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

The LM lane (`LmLane`, server/lanes/lm_lane.py) batches the decode steps of every
generating session on one model; a stream lane (`StreamLane`) runs streaming
calls that are not batched (a reply from an OpenAI-compatible server, the echo
responder) as tasks it owns, at most `concurrency` at once, in priority order.
All four kinds are lanes of this one scheduler: named by the server when it
registers them (engines do not know lane names), loaded, started and closed
together. Sessions and servicers reach them only through the typed handles of
server/lanes/access.py.

An engine reports a per-item failure by returning an exception instance as
that item's result. When `step` raises for a batch, its items are stepped one
by one, so one bad item (say, of a stream its session just closed) fails alone;
that is also the retry for an out-of-memory step, since one item may fit where
the batch did not. An item whose step raised gets a `StepFailed` naming the lane
(server/lanes/faults.py), with what the step raised as its cause.

Step deadlines. A lane may have a step deadline (`LanePolicy.step_deadline_s`,
set where the server registers the lanes). A step that runs past it fails its
items at the deadline (`StepDeadlineExceeded`), so the sessions and calls waiting
on them get an error at once, and the lane counts it
(`rtmedia_lane_deadline_misses_total`). A thread cannot be stopped and an engine
need not be thread-safe, so the runner of that step takes no other step until it
returns: while every runner that serves an item's queue is in that state, the
lane is stalled for that item, and `submit` refuses it at once with `LaneStalled`
(retryable: UNAVAILABLE for a call) rather than let it queue behind a step that
may never end; items already queued then fail the same way. When the step
returns (its results are dropped) the runner takes work again. A tick lane's
hung step has no items to fail: the tick waits for it, counted and watched the
same way. The LM lane (server/lanes/lm_lane.py) applies the same rules to its prefill
and decode steps.

Health. Each lane keeps a `LaneHealth`: the steps past their deadline and the
current run of failed steps. The scheduler's health watch reads it, and the
engine's own `fault()` where it has one (engines/base.py), a few times a second:
a lane is unhealthy while a step has run past its deadline for longer than
`unhealthy_after_s`, while every step it ran for that long failed (at least
`LaneHealth.FAILED_STEPS` of them, the last within that time), or while its
engine reports a fault. The watch sets `rtmedia_lane_healthy{lane}`, logs one
line when a lane becomes unhealthy and one when it recovers, and tells the
listeners (`on_health`: the server's health service).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rtmedia.engines.base import Engine, EngineError
from rtmedia.server.lanes.clock import SYSTEM_CLOCK, Clock
from rtmedia.server.lanes.faults import LaneStalled, StepDeadlineExceeded, describe, step_failed
from rtmedia.server.lanes.lane_base import LaneHealth, LanePolicy, Priority, wait_step
from rtmedia.server.lanes.lm_lane import LmLane
from rtmedia.server.observe.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")


# How often the scheduler's health watch looks at the lanes, in seconds.
HEALTH_PERIOD_S = 0.25


class _Runner:
    """One runner of a lane: its worker thread, the queue it takes from, and the step it is
    waiting on past its deadline, if any."""

    def __init__(self, index: int, queue: int, executor: ThreadPoolExecutor) -> None:
        self.index = index
        self.queue = queue
        self.executor = executor
        self.hung: asyncio.Future[Any] | None = None
        self.started = 0.0  # monotonic start of its current step


class Lane:
    """One engine's queue, batch policy and worker threads. `step` is what a batch runs
    (default: the engine's `step`, looked up at each batch; the `asr_final` lane runs the
    recogniser's urgent step)."""

    def __init__(self, name: str, engine: Engine, policy: LanePolicy, scheduler: Scheduler,
                 step: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.engine = engine
        self.name = name
        self.policy = policy
        self.priority = policy.priority
        self._step_fn = step
        self._scheduler = scheduler
        self._metrics = scheduler.metrics
        self.health = LaneHealth()
        # Heaps of [priority, due, seq, item, future], one per shard; withdrawn entries have future done.
        self._queues: list[list[list[Any]]] = [[] for _ in range(policy.concurrency if policy.shard else 1)]
        self._seq = 0
        self._ready = asyncio.Condition()
        # One thread per runner (a runner runs one step at a time), started with the lane.
        self._state = [_Runner(i, i % len(self._queues),
                               ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.name}-{i}"))
                       for i in range(policy.concurrency)]
        self._runners: list[asyncio.Task[None]] = []

    @property
    def waiting(self) -> int:
        return sum(1 for queue in self._queues for entry in queue if not entry[4].done())

    def start(self) -> None:
        self._runners = []
        for runner in self._state:
            runner.executor.submit(lambda: None)  # starts its thread now rather than at the first step
            self._runners.append(asyncio.create_task(self._run(runner), name=f"lane-{self.name}-{runner.index}"))

    def _queue_index(self, item: Any) -> int:
        shard = self.policy.shard
        return shard(item) % len(self._queues) if shard else 0

    def _depth(self) -> None:
        self._metrics.lane_queue_depth.labels(self.name).set(sum(map(len, self._queues)))

    def stalled(self, queue: int = 0) -> bool:
        """Every runner that serves `queue` waits on a step past its deadline."""
        return all(r.hung is not None for r in self._state if r.queue == queue)

    def _stalled_error(self, queue: int) -> LaneStalled:
        now = time.monotonic()
        longest = max(now - r.started for r in self._state if r.queue == queue)
        return LaneStalled(self.name, f"the {self.name} lane is stalled: a step has run {longest:.1f} s, past its "
                                      f"{self.policy.step_deadline_s:g} s deadline, and the engine takes no other "
                                      "step until it returns; retry shortly")

    async def submit(self, item: Any, priority: Priority | None = None, due: float | None = None) -> Any:
        index = self._queue_index(item)
        if self.stalled(index):
            raise self._stalled_error(index)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._seq += 1
        rank = self.policy.priority if priority is None else priority
        async with self._ready:
            heapq.heappush(self._queues[index], [rank, loop.time() if due is None else due, self._seq, item, future])
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

    async def _run(self, runner: _Runner) -> None:
        queue = self._queues[runner.queue]
        while True:
            if runner.hung is not None:
                await asyncio.wait({runner.hung})
                self._recovered(runner)
            batch = await self._next_batch(queue)
            if not batch:
                continue
            items = [entry[3] for entry in batch]
            started = time.perf_counter()
            try:
                results = await self._step_batch(runner, items)
            except StepDeadlineExceeded as exc:
                results = [exc] * len(items)
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

    async def _step_batch(self, runner: _Runner, items: list[Any]) -> list[Any]:
        """The batch's results; when the step raises, its items stepped one by one."""
        try:
            results = await self._timed(runner, self._step, items)
            if len(results) != len(items):
                raise EngineError(f"{self.name}.step returned {len(results)} results for {len(items)} items")
        except StepDeadlineExceeded:
            raise
        except Exception as exc:  # the batch failed: find out which items did, one by one
            self.health.step_done(False)
            self._metrics.lane_step_failures.labels(self.name).inc()
            log.exception("lane %s: step failed (%d items)", self.name, len(items))
            if len(items) == 1:
                return [step_failed(self.name, exc)]
            results = []
            for n, item in enumerate(items):
                try:
                    ok, value = await self._timed(runner, self._step_one, item)
                except StepDeadlineExceeded as late:  # this item and the ones not stepped yet fail
                    return results + [late] * (len(items) - n)
                self.health.step_done(ok)
                results.append(value)
            return results
        self.health.step_done(True)
        return results

    def _step(self, items: list[Any]) -> list[Any]:
        return (self._step_fn or self.engine.step)(items)

    def _step_one(self, item: Any) -> tuple[bool, Any]:
        try:
            return True, self._step([item])[0]
        except Exception as exc:
            return False, step_failed(self.name, exc)

    async def _timed(self, runner: _Runner, fn: Callable[[Any], T], arg: Any) -> T:
        """`fn(arg)` in the runner's thread, within the lane's step deadline."""
        runner.started = time.monotonic()
        future = asyncio.get_running_loop().run_in_executor(runner.executor, fn, arg)
        return await wait_step(future, self.policy.step_deadline_s, lambda: self._late(runner, future))

    def _late(self, runner: _Runner, future: asyncio.Future[Any]) -> StepDeadlineExceeded:
        """The runner's step passed its deadline: the runner waits for it, and a stalled queue's
        items fail now."""
        deadline = self.policy.step_deadline_s
        runner.hung = future
        self.health.hung[runner.index] = time.monotonic()
        self._metrics.lane_deadline_misses.labels(self.name).inc()
        log.error("lane %s: a step ran past its %g s deadline; its items failed, and runner %d takes no other "
                  "step until it returns", self.name, deadline, runner.index)
        if self.stalled(runner.queue):
            error, queue = self._stalled_error(runner.queue), self._queues[runner.queue]
            for entry in queue:
                if not entry[4].done():
                    entry[4].set_exception(error)
            queue.clear()
            self._depth()
        return StepDeadlineExceeded(self.name, f"the {self.name} lane's step ran past its {deadline:g} s deadline; "
                                               "this work failed, and the engine may be stuck")

    def _recovered(self, runner: _Runner) -> None:
        future, runner.hung = runner.hung, None
        self.health.hung.pop(runner.index, None)
        outcome = "failed" if future is not None and not future.cancelled() and future.exception() else "returned"
        log.warning("lane %s: the step past its deadline %s after %.1f s; runner %d takes work again",
                    self.name, outcome, time.monotonic() - runner.started, runner.index)

    async def close(self) -> None:
        await _cancel_all(self._runners)
        for queue in self._queues:
            for entry in queue:
                entry[4].cancel()
            queue.clear()
        for runner in self._state:  # a step hung past its deadline is not waited for
            runner.executor.shutdown(wait=runner.hung is None, cancel_futures=True)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class TickLane:
    """A lane that runs every `period_ms`: `collect()` on the loop gathers the work
    of every live session, `process(work)` runs it as one batched step in the
    lane's thread, `deliver(results)` hands the results back on the loop. A tick
    whose step outlasts the period counts a deadline miss. A step past
    `step_deadline_s` has no items to fail: the tick waits for it (its sessions'
    input queues up meanwhile, bounded by their inboxes), logs it, and the health
    watch sees it; its results are delivered when it returns. The period runs on `clock`
    (server/lanes/clock.py)."""

    def __init__(self, name: str, engine: Engine, period_ms: float, collect: Callable[[], Any],
                 process: Callable[[Any], Any], deliver: Callable[[Any], None], scheduler: Scheduler,
                 step_deadline_s: float | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.engine = engine
        self.name = name
        self.period = period_ms / 1000
        self.clock = clock
        self.priority = Priority.REALTIME
        self.step_deadline_s = step_deadline_s
        self.health = LaneHealth()
        self._collect, self._process, self._deliver = collect, process, deliver
        self._metrics = scheduler.metrics
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tick-{self.name}")
        self._task: asyncio.Task[None] | None = None
        self._hung = False
        self._sleep: asyncio.Future[None] | None = None  # the wait for the next tick
        self._woken = False
        self.ticks = 0

    @property
    def waiting(self) -> int:
        return 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"tick-{self.name}")

    def wake(self) -> None:
        """Run a step now, between two ticks (work that should not wait up to a period for the
        next); the ticks keep their times."""
        if self._sleep is not None and not self._sleep.done():
            self._woken = True
            self._sleep.set_result(None)

    async def _step(self, work: Any) -> Any:
        """The tick's step; past its deadline, marked hung until it returns."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._process, work)
        try:
            return await wait_step(future, self.step_deadline_s,
                                   lambda: StepDeadlineExceeded(self.name, f"the {self.name} tick ran past its deadline"))
        except StepDeadlineExceeded:
            pass
        self._hung = True
        self.health.hung[0] = time.monotonic()
        log.error("tick lane %s: a step ran past its %g s deadline; the tick waits for it", self.name,
                  self.step_deadline_s)
        try:
            return await future
        finally:
            self._hung = False
            self.health.hung.pop(0, None)
            log.warning("tick lane %s: the step past its deadline ended; ticking again", self.name)

    async def _run(self) -> None:
        clock = self.clock
        next_tick = clock.now()
        while True:
            if not self._woken:
                next_tick += self.period
            self._woken = False
            work = self._collect()
            if work:
                started = time.perf_counter()
                try:  # a failed step or delivery costs one tick, never the lane
                    results = await self._step(work)
                except Exception as exc:
                    self.health.step_done(False)
                    self._metrics.lane_step_failures.labels(self.name).inc()
                    log.exception("tick lane %s: step failed: %s", self.name, describe(exc))
                else:
                    self.health.step_done(True)
                    try:
                        self._deliver(results)
                    except Exception:
                        self._metrics.lane_step_failures.labels(self.name).inc()
                        log.exception("tick lane %s: delivery failed", self.name)
                elapsed = time.perf_counter() - started
                self._metrics.lane_step_seconds.labels(self.name).observe(elapsed)
                self._metrics.lane_batch_size.labels(self.name).observe(len(work))
                if elapsed > self.period:
                    self._metrics.lane_deadline_misses.labels(self.name).inc()
            self.ticks += 1
            if self._woken:
                continue
            delay = next_tick - clock.now()
            if delay < 0:  # fell behind: skip the missed ticks rather than bursting
                next_tick = clock.now()
                delay = 0
            self._sleep = asyncio.get_running_loop().create_future()
            timer = clock.call_later(delay, _settle, self._sleep)
            try:
                await self._sleep
            finally:
                timer.cancel()

    async def close(self) -> None:
        if self._task is not None:
            await _cancel_all([self._task])
        self._executor.shutdown(wait=not self._hung, cancel_futures=True)


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
        self.health = LaneHealth()  # calls that fail one after another (a broken upstream)

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
                self.health.step_done(True)
                await out.put((False, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.health.step_done(False)
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
    started and closed here, and nothing else calls an engine. Its health watch (module
    docstring) keeps `unhealthy` (lane -> why) and tells the `on_health` listeners."""

    def __init__(self, metrics: Metrics, unhealthy_after_s: float = 10.0) -> None:
        self.metrics = metrics
        self.lanes: dict[str, Lane | TickLane | LmLane | StreamLane] = {}
        self._progress = asyncio.Event()
        self.unhealthy_after_s = unhealthy_after_s
        self.unhealthy: dict[str, str] = {}
        self._listeners: list[Callable[[dict[str, str]], Awaitable[None]]] = []
        self._watch: asyncio.Task[None] | None = None

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
                 process: Callable[[Any], Any], deliver: Callable[[Any], None],
                 step_deadline_s: float | None = None, clock: Clock = SYSTEM_CLOCK) -> TickLane:
        """A lane that runs every `period_ms` of `clock` over the work `collect()` gathers (see TickLane)."""
        lane: TickLane = self._register(TickLane(name, engine, period_ms, collect, process, deliver, self,
                                                 step_deadline_s, clock))
        return lane

    def add_lm(self, name: str, engine: Any, step_deadline_s: float | None = None) -> LmLane:
        """The continuous-batching lane of one LM engine (server/lanes/lm_lane.py)."""
        lane: LmLane = self._register(LmLane(name, engine, self.metrics, step_deadline_s))
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

    # ---- health --------------------------------------------------------------------------
    def on_health(self, listener: Callable[[dict[str, str]], Awaitable[None]]) -> None:
        """`await listener(unhealthy)` whenever the set of unhealthy lanes changes."""
        self._listeners.append(listener)

    def _problem(self, lane: Any, now: float) -> str | None:
        why = lane.health.problem(now, self.unhealthy_after_s)
        fault = getattr(lane.engine, "fault", None)
        if why is None and fault is not None:
            why = fault()
        return why

    async def check_health(self) -> dict[str, str]:
        """Look at every lane once: update `unhealthy` and the gauges, log and tell the
        listeners about a change. Returns `unhealthy`."""
        now = time.monotonic()
        unhealthy = {}
        for name, lane in self.lanes.items():
            try:
                why = self._problem(lane, now)
            except Exception as exc:  # an engine's fault() that raises says as much
                why = f"its engine's fault check raised {describe(exc)}"
            if why is not None:
                unhealthy[name] = why
        if unhealthy.keys() == self.unhealthy.keys():
            self.unhealthy = unhealthy
            return unhealthy
        for name in unhealthy.keys() - self.unhealthy.keys():
            log.error("lane %s is unhealthy: %s", name, unhealthy[name], extra={"lane": name})
            self.metrics.lane_healthy.labels(name).set(0)
        for name in self.unhealthy.keys() - unhealthy.keys():
            log.warning("lane %s recovered", name, extra={"lane": name})
            self.metrics.lane_healthy.labels(name).set(1)
        self.unhealthy = unhealthy
        for listener in self._listeners:
            await listener(dict(unhealthy))
        return unhealthy

    async def _watch_health(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # a listener's failure must not end the watch
                log.exception("lane health check failed")
            await asyncio.sleep(HEALTH_PERIOD_S)

    # ---- lifecycle -------------------------------------------------------------------------
    async def load(self) -> None:
        """Load and warm up every engine, off the event loop, all at once: their loads mostly
        wait (worker processes starting, files read, graphs compiled in native code), so the
        server is ready when its slowest engine is, not after the sum of them."""
        async def ready(engine: Any) -> None:
            started = time.perf_counter()
            await asyncio.to_thread(engine.load)
            await asyncio.to_thread(engine.warmup)
            log.info("engine %s ready in %.2f s", engine.name, time.perf_counter() - started)

        async with asyncio.TaskGroup() as group:
            for engine in self._engines():
                group.create_task(ready(engine), name=f"load-{engine.name}")

    def start(self) -> None:
        for name, lane in self.lanes.items():
            lane.start()
            self.metrics.lane_healthy.labels(name).set(1)
        self._watch = asyncio.create_task(self._watch_health(), name="lane-health")

    async def submit(self, lane: str, item: Any, priority: Priority | None = None,
                     due: float | None = None) -> Any:
        return await self.lane(lane).submit(item, priority, due)

    async def close(self) -> None:
        if self._watch is not None:
            await _cancel_all([self._watch])
        for lane in self.lanes.values():
            await lane.close()
        for engine in self._engines():
            await asyncio.to_thread(engine.close)
