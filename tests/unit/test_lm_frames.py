"""Frame-synchronous LM stepping on a synthetic tiny Llama: the tick holds while sessions join and
leave, each active session advances exactly once per tick, long sessions wrap, capacity search."""

from __future__ import annotations

import time

import pytest
import torch
from rtmedia.engines.base import EngineError
from rtmedia.engines.lm.engine import LmEngine
from rtmedia.engines.lm.frames import PROMPT_TOKENS, FrameClock, FrameReport, capacity
from rtmedia.engines.lm.synthetic import SHAPES, describe, synthetic_llama


@pytest.fixture(scope="module")
def engine():
    eng = LmEngine(model=synthetic_llama("tiny"), slots=4, context=24, batch_sizes=(1, 2, 4))
    eng.load()
    eng.warmup()
    yield eng
    eng.close()


@pytest.mark.serial  # a real-time margin: beside the parallel part's servers its 100 ms tick ran late
def test_tick_holds_with_sessions_joining_and_leaving(engine: LmEngine) -> None:
    clock = FrameClock(engine, tick_s=0.1)  # a tiny model's step takes ~ms: wide margins for a loaded box
    joined: dict[str, int] = {}

    def events(k: int) -> None:
        if k == 0:
            joined["a"], joined["b"] = clock.join(), clock.join()
        elif k == 3:
            joined["c"] = clock.join()
        elif k == 6:
            clock.leave(joined["a"])

    started = time.monotonic()
    report = clock.run(10, events)
    elapsed = time.monotonic() - started
    try:
        assert report.ticks == 10 and report.sessions == [2, 2, 2, 3, 3, 3, 2, 2, 2, 2]
        assert clock.steps == {joined["b"]: 10, joined["c"]: 7}  # once per tick while active
        assert engine.length(joined["b"]) == PROMPT_TOKENS + 10
        assert engine.length(joined["a"]) == 0  # released at its leave
        assert 9 * 0.1 <= elapsed < 9 * 0.1 + 1.0  # absolute schedule: no drift
        assert report.late <= 2 and len(report.steps_s) == 10
    finally:
        clock.close()
    assert engine.slots_free == 4


def test_long_sessions_wrap_at_the_context(engine: LmEngine) -> None:
    clock = FrameClock(engine, tick_s=0.001)
    slot = clock.join()
    clock.run(40)
    assert clock.steps[slot] == 40 and PROMPT_TOKENS < engine.length(slot) <= engine.context
    clock.close()


def test_join_without_free_slots(engine: LmEngine) -> None:
    clock = FrameClock(engine, tick_s=0.01)
    for _ in range(4):
        clock.join()
    with pytest.raises(EngineError):
        clock.join()
    clock.close()
    assert engine.slots_free == 4


def test_capacity_and_report(engine: LmEngine) -> None:
    best, tried = capacity(engine, tick_s=1.0, counts=(1, 2, 4, 8), ticks=3)
    assert best == 4 and [t["sessions"] for t in tried] == [1, 2, 4]
    assert all(t["realtime"] and t["ticks"] == 3 for t in tried)
    slow = FrameReport(0.01, steps_s=[0.001] * 98 + [0.05, 0.05])
    assert not slow.realtime and slow.percentile(50) == 0.001
    assert engine.slots_free == 4


def test_synthetic_shapes() -> None:
    model = synthetic_llama("tiny", seed=3)
    again = synthetic_llama("tiny", seed=3)
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded
    assert model.config.vocab_size == SHAPES["tiny"]["vocab_size"]
    assert "random weights" in describe("7b")
    with pytest.raises(ValueError):
        synthetic_llama("3t")
