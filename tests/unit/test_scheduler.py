"""The scheduler as pure logic: fake engines at the edge, real lanes and ticks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from rtmedia.engines.base import EngineError
from rtmedia.server.lanes.scheduler import LanePolicy, Priority, Scheduler
from rtmedia.server.observe.metrics import Metrics

from tests.support.fake_clock import FakeClock
from tests.support.waits import until


class FakeEngine:
    """Records batches; results are the items doubled, or an exception for "boom"."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.batches: list[list] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a step began (it may wait on `gate`)

    def load(self) -> None: ...
    def warmup(self) -> None: ...
    def close(self) -> None: ...

    def step(self, items):
        self.entered.set()
        self.gate.wait(5)
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(items))
        time.sleep(self.delay)
        if "fail-batch" in items:
            raise RuntimeError("the whole batch failed")
        return [ValueError(f"bad item {i}") if i == "boom" else i * 2 for i in items]


@pytest.fixture
async def scheduler():
    s = Scheduler(Metrics())
    yield s
    await s.close()


async def test_batches_run_off_the_loop_and_resolve_in_order(scheduler):
    engine = FakeEngine("e")
    scheduler.add(engine.name, engine, LanePolicy(max_batch=8, max_wait_ms=20))
    scheduler.start()
    results = await asyncio.gather(*(scheduler.submit("e", i) for i in range(5)))
    assert results == [0, 2, 4, 6, 8]
    assert engine.batches == [[0, 1, 2, 3, 4]], "max_wait_ms gathers the items into one batch"
    assert engine.threads == {"engine-e-0_0"}
    assert scheduler.metrics.registry.get_sample_value("rtmedia_lane_batch_size_sum", {"lane": "e"}) == 5


async def test_max_batch_splits(scheduler):
    engine = FakeEngine("e")
    scheduler.add(engine.name, engine, LanePolicy(max_batch=2, max_wait_ms=20))
    scheduler.start()
    await asyncio.gather(*(scheduler.submit("e", i) for i in range(5)))
    assert [len(b) for b in engine.batches] == [2, 2, 1]


async def test_item_and_batch_failures(scheduler):
    scheduler.add("e", FakeEngine("e"), LanePolicy(max_batch=8, max_wait_ms=20))
    scheduler.start()
    ok, bad = await asyncio.gather(scheduler.submit("e", 1), scheduler.submit("e", "boom"), return_exceptions=True)
    assert ok == 2 and isinstance(bad, ValueError) and "bad item boom" in str(bad)
    with pytest.raises(RuntimeError, match="whole batch"):
        await scheduler.submit("e", "fail-batch")
    bad, good = await asyncio.gather(scheduler.submit("e", "fail-batch"), scheduler.submit("e", 4),
                                     return_exceptions=True)
    assert isinstance(bad, RuntimeError) and good == 8, "a failing batch is retried item by item"
    assert await scheduler.submit("e", 3) == 6, "the lane goes on after a failed batch"
    assert scheduler.metrics.registry.get_sample_value("rtmedia_lane_step_failures_total", {"lane": "e"}) == 2


async def _order_taken(scheduler, submissions) -> list:
    """Hold the lane's first batch, queue (item, priority, due) submissions, release: the order
    in which the items ran."""
    engine = FakeEngine("e")
    engine.gate.clear()
    scheduler.add(engine.name, engine, LanePolicy(max_batch=1))
    scheduler.start()
    first = asyncio.ensure_future(scheduler.submit("e", 0))
    await until(engine.entered.is_set, what="the first batch in its step")
    order = []

    async def tracked(item, priority, due):
        await scheduler.submit("e", item, priority, due)
        order.append(item)

    tasks = [asyncio.ensure_future(tracked(*submission)) for submission in submissions]
    await until(lambda: scheduler.lanes["e"].waiting == len(submissions), what="every submission queued")
    engine.gate.set()
    await asyncio.gather(first, *tasks)
    return order


async def test_priority_order_within_a_lane(scheduler):
    order = await _order_taken(scheduler, [(1, Priority.BULK, None), (2, Priority.INTERACTIVE, None),
                                           (3, Priority.REALTIME, None), (4, Priority.REALTIME, None)])
    assert order == [3, 4, 2, 1]


async def test_due_items_sort_by_due_time_within_a_priority(scheduler):
    """An item due later waits behind one submitted after it but due sooner; an item without
    `due` counts as due when it arrived; priority still comes first."""
    now = asyncio.get_running_loop().time()
    order = await _order_taken(scheduler, [
        (1, Priority.REALTIME, now + 5),  # plenty of slack
        (2, Priority.REALTIME, None),  # due on arrival
        (3, Priority.REALTIME, now - 1),  # overdue
        (4, Priority.INTERACTIVE, now - 9),  # lower priority
    ])
    assert order == [3, 2, 1, 4]


async def test_a_sharded_lane_runs_each_shard_on_its_own(scheduler):
    """Runner i takes only the items of shard i: a held batch of one shard does not hold up
    the other shard's items, and no batch mixes shards."""

    class HeldEvens(FakeEngine):
        def step(self, items):
            if items[0] % 2 == 0:
                self.entered.set()
                self.gate.wait(5)
            self.batches.append(list(items))
            return [i * 2 for i in items]

    engine = HeldEvens("e")
    engine.gate.clear()
    scheduler.add(engine.name, engine, LanePolicy(max_batch=8, concurrency=2, shard=lambda item: item % 2))
    scheduler.start()
    held = [asyncio.ensure_future(scheduler.submit("e", 0))]
    await until(engine.entered.is_set, what="0's batch in its step")
    held.append(asyncio.ensure_future(scheduler.submit("e", 2)))
    await until(lambda: scheduler.lanes["e"].waiting == 1, what="2 queued")
    assert await asyncio.wait_for(asyncio.gather(scheduler.submit("e", 1), scheduler.submit("e", 3)), 2) == [2, 6]
    assert not any(f.done() for f in held) and scheduler.lanes["e"].waiting == 1  # 2 waits behind 0
    engine.gate.set()
    assert await asyncio.gather(*held) == [0, 4]
    assert all(len({i % 2 for i in batch}) == 1 for batch in engine.batches)


async def test_cancelled_caller_withdraws_its_item(scheduler):
    engine = FakeEngine("e")
    engine.gate.clear()
    scheduler.add(engine.name, engine, LanePolicy(max_batch=4))
    scheduler.start()
    first = asyncio.ensure_future(scheduler.submit("e", 0))
    await until(engine.entered.is_set, what="the first batch in its step")
    withdrawn = asyncio.ensure_future(scheduler.submit("e", 1))
    kept = asyncio.ensure_future(scheduler.submit("e", 2))
    await until(lambda: scheduler.lanes["e"].waiting == 2, what="1 and 2 queued")
    withdrawn.cancel()
    engine.gate.set()
    assert await first == 0 and await kept == 4
    assert [1] not in engine.batches and all(1 not in b for b in engine.batches)


async def test_bulk_lane_waits_for_realtime_work(scheduler):
    """A BULK step starts only once no speech item is waiting (it may overlap the last one)."""
    starts: list[str] = []
    speech, video = FakeEngine("speech", delay=0.05), FakeEngine("video")
    for engine in (speech, video):
        step = engine.step
        engine.step = lambda items, step=step, name=engine.name: starts.append(name) or step(items)
    scheduler.add(speech.name, speech, LanePolicy(Priority.REALTIME, max_batch=1))
    scheduler.add(video.name, video, LanePolicy(Priority.BULK, max_batch=1))
    scheduler.start()
    await asyncio.gather(*(scheduler.submit("speech", i) for i in range(3)), scheduler.submit("video", 9))
    # the last speech item leaves the queue before the video step may start; its step can start after it
    assert starts[:2] == ["speech", "speech"] and sorted(starts[2:]) == ["speech", "video"], starts


async def test_tick_lane_collects_processes_delivers_and_counts_misses(scheduler):
    delivered = []
    calls = {"n": 0}

    def collect():
        calls["n"] += 1
        return [calls["n"]] if calls["n"] <= 3 else []

    def process(work):
        time.sleep(0.03 if work == [2] else 0)
        return [w * 10 for w in work]

    tick = scheduler.add_tick("vad", FakeEngine("vad"), 20, collect, process, delivered.append)
    scheduler.start()
    await until(lambda: tick.ticks >= 5, what="five ticks")
    assert delivered == [[10], [20], [30]]
    assert tick.ticks >= 5
    assert scheduler.metrics.registry.get_sample_value("rtmedia_lane_deadline_misses_total", {"lane": "vad"}) == 1


async def test_a_tick_lane_keeps_its_period_on_its_clock(scheduler):
    """The period runs on the lane's clock: on a clock a test moves, a tick comes exactly when
    the clock passes it, and none comes while the clock stands still."""
    clock = FakeClock()
    seen: list[float] = []

    def collect():
        seen.append(clock.now())
        return []

    tick = scheduler.add_tick("vad", FakeEngine("vad"), 20, collect, lambda work: work, lambda results: None,
                              clock=clock)
    scheduler.start()
    await until(lambda: tick.ticks >= 1, what="the start's tick")
    await clock.settle()
    assert tick.ticks == 1
    await clock.advance(19)
    assert tick.ticks == 1
    await clock.advance(1)
    assert tick.ticks == 2
    await clock.advance(100)
    assert tick.ticks == 7
    assert [round((t - seen[0]) * 1000) for t in seen] == [0, 20, 40, 60, 80, 100, 120]


async def test_tick_lane_survives_a_failed_delivery(scheduler):
    """A delivery that raises (e.g. to a session closed while the step ran) costs one
    tick; the lane keeps ticking."""
    delivered = []
    calls = {"n": 0}

    def collect():
        calls["n"] += 1
        return [calls["n"]] if calls["n"] <= 3 else []

    def deliver(results):
        if results == [2]:
            raise RuntimeError("session gone")
        delivered.append(results)

    scheduler.add_tick("vad", FakeEngine("vad"), 10, collect, lambda work: work, deliver)
    scheduler.start()
    await until(lambda: calls["n"] >= 5, what="the ticks after the work ran out")  # ticks 1-3 delivered
    assert delivered == [[1], [3]]
    assert scheduler.metrics.registry.get_sample_value("rtmedia_lane_step_failures_total", {"lane": "vad"}) == 1


async def test_a_woken_tick_lane_steps_at_once_and_keeps_its_period(scheduler):
    """wake() runs a step between two ticks (a semantic_vad stop need not wait for the next)."""
    work: list[str] = []
    stepped: list[asyncio.Future] = []

    def process(items):
        return items

    def deliver(results):
        if stepped and not stepped[0].done():
            stepped.pop(0).set_result(results)

    def collect():
        out, work[:] = list(work), []
        return out

    tick = scheduler.add_tick("vad", FakeEngine("vad"), 10_000, collect, process, deliver)  # one tick at start
    scheduler.start()
    await until(lambda: tick.ticks >= 1, what="the start's tick")
    loop = asyncio.get_running_loop()
    for n in range(2):
        stepped.append(loop.create_future())
        work.append(f"stop {n}")
        tick.wake()
        assert await asyncio.wait_for(stepped[-1], 5) == [f"stop {n}"]
    assert 2 <= tick.ticks <= 3  # the start's tick and the woken steps; no 10 s tick came


def test_vad_tick_drops_results_of_a_closed_session():
    from rtmedia.server.hearing.audio_input import AudioInput, VadTick
    from rtmedia.server.session.config import SessionSettings

    got: dict[str, list] = {"open": [], "closed": []}
    tick = VadTick(engine=None)  # type: ignore[arg-type]
    inputs = {name: AudioInput(SessionSettings(turn_type="none"), 2000, got[name].extend, None) for name in got}
    tick.inputs.update(inputs.values())
    tick.inputs.discard(inputs["closed"])  # Session.close() while the step ran
    tick.deliver([(inputs["open"], [("stopped", 100)]), (inputs["closed"], [("stopped", 100)])])
    assert got == {"open": [("stopped", 100)], "closed": []}


def test_vad_tick_only_counts_audio_that_nothing_uses():
    """No VAD and no transcription: the tick skips the decode but keeps markers and the
    input offset, so turning transcription on later continues at the right offset."""
    import dataclasses

    from rtmedia.server.hearing.audio_input import AudioInput, VadTick
    from rtmedia.server.session.config import SessionSettings

    got: list = []
    tick = VadTick(engine=None)  # type: ignore[arg-type]
    settings = SessionSettings(turn_type="none", transcription=False, input_rate=24000)
    inp = AudioInput(settings, 2000, got.extend, None)
    tick.inputs.add(inp)
    inp.append(bytes(2 * 480))  # 20 ms at 24 kHz
    inp.after_input(lambda: None)
    inp.append(bytes(2 * 480))
    tick.deliver(tick.process(tick.collect()))
    assert [kind for kind, _ in got] == ["marker"]
    inp.reconfigure(dataclasses.replace(settings, transcription=True), reset=False)
    got.clear()
    inp.append(bytes(2 * 2400))  # 100 ms
    tick.deliver(tick.process(tick.collect()))
    assert [kind for kind, _ in got] == ["audio"]
    assert got[0][1][0] == 40  # ms: after the 40 ms counted while nothing used the audio


async def test_a_lane_name_is_the_servers_and_one_engine_may_serve_two_lanes(scheduler):
    """Lanes are named when registered (asr and asr_final share the recogniser, each with its own
    step); the shared engine is loaded and closed once."""
    engine = FakeEngine("recogniser")
    loads = []
    engine.load = lambda: loads.append("load")  # type: ignore[method-assign]
    scheduler.add("plain", engine, LanePolicy(max_batch=1))
    scheduler.add("urgent", engine, LanePolicy(max_batch=1), step=lambda items: [f"urgent {i}" for i in items])
    with pytest.raises(ValueError, match="registered already"):
        scheduler.add("plain", engine, LanePolicy())
    await scheduler.load()
    scheduler.start()
    assert await scheduler.submit("plain", 3) == 6
    assert await scheduler.submit("urgent", 3) == "urgent 3"
    assert loads == ["load"]


async def _call(values, gate=None, fail=None):
    for value in values:
        if gate is not None:
            await gate.wait()
        yield value
    if fail is not None:
        raise fail


def _lane_calls(lane: str) -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(f"lane-{lane}")]


async def test_stream_lane_admits_in_priority_order_and_owns_its_calls(scheduler):
    lane = scheduler.add_stream("reply", LanePolicy(Priority.INTERACTIVE, concurrency=1))
    scheduler.start()
    gate = asyncio.Event()
    order: list[str] = []

    async def consume(name, priority, gated=False):
        async for value in lane.stream(lambda: _call([name], gate if gated else None), priority):
            order.append(value)

    first = asyncio.create_task(consume("first", Priority.BULK, gated=True))
    await until(lambda: _lane_calls("reply"), what="the first call running")
    bulk = asyncio.create_task(consume("bulk", Priority.BULK))
    realtime = asyncio.create_task(consume("realtime", Priority.REALTIME))
    await until(lambda: lane.waiting == 2, what="the other two calls waiting")
    assert lane.waiting == 2 and order == [], "one call at a time: the others wait for the first"
    gate.set()
    await asyncio.gather(first, bulk, realtime)
    assert order == ["first", "realtime", "bulk"]
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("lane-reply")] == []


async def test_stream_lane_cancels_a_call_whose_caller_leaves_and_raises_its_error(scheduler):
    lane = scheduler.add_stream("reply", LanePolicy(concurrency=1))
    scheduler.start()
    never = asyncio.Event()
    stream = lane.stream(lambda: _call(["a", "b"], never))
    consumer = asyncio.create_task(anext(stream))
    await until(lambda: _lane_calls("reply"), what="the call running")
    calls = [t for t in asyncio.all_tasks() if t.get_name().startswith("lane-reply")]
    assert len(calls) == 1, "the call runs as a task the lane names"
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert calls[0].cancelled(), "a caller that goes away cancels its call"
    with pytest.raises(RuntimeError, match="upstream broke"):
        [v async for v in lane.stream(lambda: _call(["x"], fail=RuntimeError("upstream broke")))]
    assert lane.waiting == 0 and [v async for v in lane.stream(lambda: _call(["y"]))] == ["y"], \
        "the lane's place was given back each time"


# ---- faults: step deadlines, out of memory, health ------------------------------------------------

class HangingEngine(FakeEngine):
    """`step` blocks while `release` is clear for a batch holding "hang"; raises MemoryError for a
    batch holding "oom" with more than one item (one item at a time fits), and for "oom-alone"."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.release = threading.Event()
        self.hanging = threading.Event()

    def step(self, items):
        self.batches.append(list(items))
        if "hang" in items:
            self.hanging.set()
            self.release.wait(10)
        if "oom-alone" in items or ("oom" in items and len(items) > 1):
            raise MemoryError()
        return [f"{i}!" for i in items]


async def test_a_step_past_its_deadline_fails_its_items_then_the_lane_refuses_until_it_returns(scheduler):
    """The hung step's items fail at the deadline; items queued behind it fail then too, and new
    ones are refused at once (LaneStalled, retryable) rather than queue behind a step that may
    never end; no second step runs on the engine meanwhile; when the step returns, the lane serves."""
    from rtmedia.engines.base import EngineUnavailable
    from rtmedia.server.lanes.faults import LaneStalled, StepDeadlineExceeded

    engine = HangingEngine("e")
    scheduler.add("e", engine, LanePolicy(max_batch=1, step_deadline_s=0.2))
    scheduler.start()
    started = time.monotonic()
    hung = asyncio.ensure_future(scheduler.submit("e", "hang"))
    await until(engine.hanging.is_set, what="the step hanging")
    queued = asyncio.ensure_future(scheduler.submit("e", "queued"))
    with pytest.raises(StepDeadlineExceeded, match=r"the e lane's step ran past its 0\.2 s deadline"):
        await hung
    assert 0.15 < time.monotonic() - started < 1.0
    with pytest.raises(LaneStalled, match="the e lane is stalled"):
        await queued
    refused = time.monotonic()
    with pytest.raises(LaneStalled) as stalled:
        await scheduler.submit("e", "new")
    assert isinstance(stalled.value, EngineUnavailable) and time.monotonic() - refused < 0.05
    assert engine.batches == [["hang"]], "nothing else ran on the engine while its step hung"
    sample = scheduler.metrics.registry.get_sample_value
    assert sample("rtmedia_lane_deadline_misses_total", {"lane": "e"}) == 1
    engine.release.set()
    # the step's return reaches the loop a moment later
    await until(lambda: not scheduler.lanes["e"].stalled(), what="the step's return")
    assert await asyncio.wait_for(scheduler.submit("e", "next"), 2) == "next!", "the lane recovered"


async def test_a_hung_shard_holds_up_only_its_own_items(scheduler):
    """A sharded lane (one recogniser worker per runner): the shard whose step hangs refuses its
    items; the other shard goes on being served."""
    from rtmedia.server.lanes.faults import LaneStalled, StepDeadlineExceeded

    engine = HangingEngine("e")
    shard = {"hang": 0, "a": 0, "b": 1, "c": 1}.__getitem__
    scheduler.add("e", engine, LanePolicy(max_batch=4, concurrency=2, shard=shard, step_deadline_s=0.1))
    scheduler.start()
    with pytest.raises(StepDeadlineExceeded):
        await scheduler.submit("e", "hang")
    assert await scheduler.submit("e", "b") == "b!"
    with pytest.raises(LaneStalled):
        await scheduler.submit("e", "a")
    assert await scheduler.submit("e", "c") == "c!"
    engine.release.set()
    await until(lambda: not scheduler.lanes["e"].stalled(0), what="shard 0's step returning")
    assert await scheduler.submit("e", "a") == "a!"


async def test_out_of_memory_fails_only_its_batch_and_the_lane_stays_healthy(scheduler):
    """A batch that runs out of memory is stepped one item at a time (a smaller step may fit); an
    item that does not fit alone fails alone, with an error that names the lane and says out of
    memory; the next request succeeds and the lane stays healthy."""
    from rtmedia.server.lanes.faults import StepFailed, fault_status, is_out_of_memory

    engine = HangingEngine("e")
    scheduler.add("e", engine, LanePolicy(max_batch=8, max_wait_ms=30))
    scheduler.start()
    results = await asyncio.gather(scheduler.submit("e", "oom"), scheduler.submit("e", 1),
                                   scheduler.submit("e", "oom-alone"), return_exceptions=True)
    assert results[:2] == ["oom!", "1!"]
    assert isinstance(results[2], StepFailed) and is_out_of_memory(results[2])
    assert str(results[2]) == "the e lane's step failed: MemoryError (out of memory)"
    assert fault_status(results[2])[1] == "OUT_OF_MEMORY"
    assert engine.batches[0] == ["oom", 1, "oom-alone"] and engine.batches[1:] == [["oom"], [1], ["oom-alone"]]
    assert await scheduler.submit("e", 2) == "2!"
    assert await scheduler.check_health() == {}


async def test_health_watch_reports_a_stalled_lane_and_its_recovery(caplog):
    """A step past its deadline for longer than `unhealthy_after_s` makes the lane unhealthy: the
    gauge says 0, one line is logged, the listeners hear it; when the step returns, all back."""
    scheduler = Scheduler(Metrics(), unhealthy_after_s=0.3)
    heard: list[dict] = []

    async def listener(unhealthy):
        heard.append(unhealthy)

    scheduler.on_health(listener)
    engine = HangingEngine("e")
    scheduler.add("e", engine, LanePolicy(max_batch=1, step_deadline_s=0.1))
    scheduler.add("other", FakeEngine("other"), LanePolicy())
    scheduler.start()
    try:
        def gauge(lane):
            return scheduler.metrics.registry.get_sample_value("rtmedia_lane_healthy", {"lane": lane})

        assert gauge("e") == gauge("other") == 1
        with pytest.raises(EngineError):
            await scheduler.submit("e", "hang")
        assert await scheduler.check_health() == {}, "stalled, but not for long yet"
        await until(lambda: scheduler.unhealthy, what="the lane unhealthy")
        assert list(scheduler.unhealthy) == ["e"] and "past its deadline" in scheduler.unhealthy["e"]
        assert gauge("e") == 0 and gauge("other") == 1 and heard == [scheduler.unhealthy]
        engine.release.set()
        await until(lambda: not scheduler.unhealthy, what="the lane healthy again")
        assert gauge("e") == 1 and heard[-1] == {} and len(heard) == 2
        logged = [r.getMessage() for r in caplog.records if r.name == "rtmedia.server.lanes.scheduler"]
        assert sum("is unhealthy" in m for m in logged) == 1 and sum("lane e recovered" in m for m in logged) == 1
    finally:
        await scheduler.close()


async def test_a_lane_whose_every_step_fails_for_a_while_is_unhealthy_until_one_succeeds():
    scheduler = Scheduler(Metrics(), unhealthy_after_s=0.2)
    scheduler.add("e", FakeEngine("e"), LanePolicy(max_batch=1))
    scheduler.start()
    try:
        started = time.monotonic()
        while time.monotonic() - started < 0.25 or scheduler.lanes["e"].health.failures < 3:
            with pytest.raises(RuntimeError, match="whole batch"):
                await scheduler.submit("e", "fail-batch")
            await asyncio.sleep(0.02)
        assert "steps failed" in (await scheduler.check_health()).get("e", "")
        assert await scheduler.submit("e", 1) == 2
        assert await scheduler.check_health() == {}
    finally:
        await scheduler.close()


async def test_an_engine_fault_makes_its_lanes_unhealthy(scheduler):
    engine = FakeEngine("e")
    engine.fault = lambda: "worker 0 could not be restarted"  # type: ignore[attr-defined]
    scheduler.add("a", engine, LanePolicy())
    scheduler.add("b", engine, LanePolicy())
    scheduler.start()
    assert await scheduler.check_health() == {"a": "worker 0 could not be restarted",
                                              "b": "worker 0 could not be restarted"}
    engine.fault = lambda: None  # type: ignore[attr-defined]
    assert await scheduler.check_health() == {}


async def test_a_hung_tick_is_watched_and_its_results_delivered_when_it_returns():
    scheduler = Scheduler(Metrics(), unhealthy_after_s=0.2)
    release, delivered, calls = threading.Event(), [], {"n": 0}

    def collect():
        calls["n"] += 1
        return [calls["n"]] if calls["n"] <= 2 else []

    def process(work):
        if work == [1]:
            release.wait(10)
        return work

    tick = scheduler.add_tick("vad", FakeEngine("vad"), 10, collect, process, delivered.append, step_deadline_s=0.1)
    scheduler.start()
    try:
        await until(lambda: "vad" in scheduler.unhealthy, what="the vad lane unhealthy")
        assert delivered == [] and "past its deadline" in scheduler.unhealthy["vad"]
        release.set()
        await until(lambda: len(delivered) == 2, what="both ticks delivered")
        assert delivered == [[1], [2]] and await scheduler.check_health() == {} and tick.ticks > 2
    finally:
        await scheduler.close()


class FakeLm:
    """Slots and next-token logits of a toy LM: after token t comes t + 1. `gate` clear: its next
    step blocks until set; `fail`: its next decode raises that."""

    VOCAB = 64

    def __init__(self, slots: int = 2) -> None:
        self.slots_total = slots
        self.free = list(range(slots))
        self.gate = threading.Event()
        self.gate.set()
        self.fail: BaseException | None = None
        self.steps = 0

    @property
    def slots_free(self) -> int:
        return len(self.free)

    def acquire(self):
        return self.free.pop(0) if self.free else None

    def release(self, slot: int) -> None:
        if slot not in self.free:
            self.free.append(slot)

    def truncate(self, slot: int, length: int) -> None: ...

    def _logits(self, token: int):
        import numpy as np

        return np.eye(self.VOCAB)[(token + 1) % self.VOCAB]

    def prefill(self, slot, ids):
        self.steps += 1
        self.gate.wait(10)
        return self._logits(ids[-1])

    def decode(self, tokens):
        self.steps += 1
        self.gate.wait(10)
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        return {slot: self._logits(token) for slot, token in tokens.items()}


async def _tokens(lane, prompt, n=4):
    return [t async for t in lane.generate(prompt, n)]


async def test_lm_lane_out_of_memory_fails_that_step_only():
    from rtmedia.server.lanes.faults import StepFailed, is_out_of_memory
    from rtmedia.server.lanes.lm_lane import LmLane

    engine = FakeLm()
    lane = LmLane("llm", engine, Metrics(), step_deadline_s=1.0)
    lane.start()
    try:
        engine.fail = MemoryError()
        with pytest.raises(StepFailed, match="the llm lane's decode step failed: MemoryError") as failed:
            await _tokens(lane, [1])
        assert is_out_of_memory(failed.value) and engine.free == [1, 0], "its slot was given back"
        assert await _tokens(lane, [1]) == [2, 3, 4, 5], "the next generation works"
    finally:
        await lane.close()


async def test_lm_lane_step_past_its_deadline_fails_and_refuses_until_it_returns():
    """A decode step past the deadline fails its generations then; one waiting for a slot fails
    too (nothing can step), a new one is refused at once; when the step returns the lane works."""
    from rtmedia.server.lanes.faults import LaneStalled, StepDeadlineExceeded
    from rtmedia.server.lanes.lm_lane import LmLane

    engine = FakeLm(slots=1)
    lane = LmLane("llm", engine, Metrics(), step_deadline_s=0.2)
    lane.start()
    try:
        first = lane.generate([1], 8)
        assert await anext(first) == 2  # prefilled; its decode steps follow
        engine.gate.clear()
        waiting = asyncio.ensure_future(_tokens(lane, [9]))
        got = []
        with pytest.raises(StepDeadlineExceeded, match=r"the llm lane's decode step ran past its 0\.2 s deadline"):
            async for token in first:
                got.append(token)
        with pytest.raises(LaneStalled):
            await waiting
        with pytest.raises(LaneStalled, match="the llm lane is stalled"):
            await _tokens(lane, [5])
        assert lane.health.hung
        engine.gate.set()
        await until(lambda: not lane.health.hung, what="the step's return")
        assert not lane.health.hung and await _tokens(lane, [5]) == [6, 7, 8, 9]
    finally:
        engine.gate.set()
        await lane.close()


def test_step_deadlines_come_from_the_config_and_bad_ones_are_refused():
    from rtmedia.server.config import STEP_DEADLINES_S, ServerConfig

    config = ServerConfig.of(lane_step_deadlines_s={"video": 600, "tts": 0})
    assert config.step_deadline("video") == 600 and config.step_deadline("tts") is None
    assert config.step_deadline("asr") == STEP_DEADLINES_S["asr"]
    with pytest.raises(ValueError, match="unknown lane 'vidoe'; lanes: vad, turn_audio, asr"):
        ServerConfig.of(lane_step_deadlines_s={"vidoe": 5})
    with pytest.raises(ValueError, match=r"video=-1 must be a number of seconds >= 0"):
        ServerConfig.of(lane_step_deadlines_s={"video": -1})
    with pytest.raises(ValueError, match="lane_unhealthy_after_s must be a positive number"):
        ServerConfig.of(lane_unhealthy_after_s=0)
