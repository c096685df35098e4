"""Graph runner bookkeeping (docs/architecture.md#cuda-graph-runner) through an injected capture backend.

The backend below stands in for CUDA at the edge of the test: "capture" runs
the function once on the static inputs and keeps its output tensors; "replay"
recomputes the function from the static inputs *into those same output
tensors*, which is what a CUDA graph does. Everything else is the runner's
own code."""

from __future__ import annotations

import pytest
import torch
from rtmedia.engines.graphs import GraphConfig, GraphRunner, GraphRunnerFailed

from tests.support.graphs import FakeBackend


def double(x):
    return x * 2


def runner(**config) -> tuple[GraphRunner, FakeBackend]:
    backend = FakeBackend(free=config.pop("free", 1 << 40))
    return GraphRunner("test", GraphConfig(**config), backend), backend


def test_admission_after_min_capture_calls_then_hits():
    r, b = runner(min_capture_calls=3)
    x = torch.ones(2)
    for _ in range(2):
        assert torch.equal(r.run(double, x), x * 2)
    assert b.captures == 0 and r.stats.misses["warmup"] == 2
    assert torch.equal(r.run(double, x), x * 2)  # third call: captured and replayed
    assert b.captures == 1 and b.replays == 1 and r.stats.hits == 1
    r.run(double, x)
    assert b.captures == 1 and r.stats.hits == 2 and r.stats.graphs == 1
    assert r.stats.hit_rate == pytest.approx(0.5)


def test_replay_consumes_new_inputs_and_outputs_are_clones():
    r, _ = runner()
    r.run(double, torch.zeros(3))
    first = r.run(double, torch.tensor([1.0, 2.0, 3.0]))
    second = r.run(double, torch.tensor([5.0, 6.0, 7.0]))
    assert torch.equal(second, torch.tensor([10.0, 12.0, 14.0]))
    assert torch.equal(first, torch.tensor([2.0, 4.0, 6.0]))  # survived the later replay
    entry = next(iter(r._graphs.values()))
    entry.inputs[0].fill_(4.0)  # mutate the static input directly: the output follows
    r.backend.replay(entry.graph)
    assert torch.equal(entry.outputs[0], torch.full((3,), 8.0))


def test_tuple_outputs_and_multiple_inputs():
    r, _ = runner()

    def fn(a, b):
        return a + b, a * b

    a, b = torch.tensor([2.0]), torch.tensor([3.0])
    for _ in range(3):
        s, p = r.run(fn, a, b)
    assert (s.item(), p.item()) == (5.0, 6.0) and r.stats.hits == 2


def test_capacity_no_eviction():
    r, b = runner(max_graphs=2)
    shapes = [torch.ones(n) for n in (1, 2, 3)]
    for x in shapes:
        r.run(double, x)
        r.run(double, x)
    assert r.stats.graphs == 2 and b.captures == 2
    assert r.stats.misses["capacity"] == 2  # once full, a new shape runs eagerly
    assert torch.equal(r.run(double, shapes[2]), shapes[2] * 2)
    assert r.stats.misses["capacity"] == 3 and r.stats.graphs == 2
    r.run(double, shapes[0])  # the first graphs stay
    assert r.stats.hits == 3


def test_admission_history_is_bounded():
    r, b = runner(max_graphs=1)  # history keeps 4 keys
    r.run(double, torch.ones(1))
    for n in range(2, 7):  # 5 other keys push the first out of the history
        r.run(double, torch.ones(n))
    assert len(r._history) == 4
    r.run(double, torch.ones(1))  # counted as a first call again
    assert b.captures == 0 and r.stats.misses["warmup"] == 7
    r.run(double, torch.ones(1))
    assert b.captures == 1


def test_memory_floor_then_later_admission():
    r, b = runner(min_free_bytes=1000, free=999)
    x = torch.ones(2)
    r.run(double, x)
    r.run(double, x)
    assert b.captures == 0 and r.stats.misses == {"ineligible": 0, "capacity": 0, "warmup": 1, "memory": 1, "failed": 0}
    b.free = 5000
    r.run(double, x)
    assert b.captures == 1 and r.stats.hits == 1


def test_memory_floor_zero_disables_check():
    r, b = runner(min_free_bytes=0, free=0)
    r.run(double, torch.ones(1))
    r.run(double, torch.ones(1))
    assert b.captures == 1


def test_one_pool_per_engine_and_stream():
    r, b = runner()
    for n in (1, 2):
        r.run(double, torch.ones(n))
        r.run(double, torch.ones(n))
    assert len(b.pools) == 1 and b.pool_of_capture == [b.pools[0]] * 2


def test_capture_failure_is_fatal():
    r, b = runner()
    b.fail = RuntimeError("operation not permitted when stream is capturing")
    x = torch.ones(1)
    r.run(double, x)
    with pytest.raises(RuntimeError, match="not permitted") as first:
        r.run(double, x)
    assert type(first.value) is RuntimeError  # the original exception
    b.fail = None
    with pytest.raises(GraphRunnerFailed):
        r.run(double, torch.ones(5))  # any later call, no retry
    assert b.captures == 0 and r.failed
    assert r.stats.capture_failures == ["RuntimeError: operation not permitted when stream is capturing"]


def test_eager_after_failure_runs_the_failed_call_and_every_later_one():
    r, b = runner(eager_after_failure=True)
    b.fail = RuntimeError("operation not permitted when stream is capturing")
    x = torch.full((2,), 3.0)
    assert r.run(double, x).tolist() == [6.0, 6.0]  # warm-up miss
    assert r.run(double, x).tolist() == [6.0, 6.0]  # the capture fails: eager
    b.fail = None
    assert r.run(double, torch.ones(5)).tolist() == [2.0] * 5  # no retry
    assert r.eager(double, x).tolist() == [6.0, 6.0] and not r.capture(double, x, tag="warm")
    assert b.captures == 0 and r.failed and r.stats.graphs == 0
    assert r.stats.misses["failed"] == 3 and r.stats.misses["warmup"] == 1
    assert r.stats.capture_failures == ["RuntimeError: operation not permitted when stream is capturing"]


def test_enforce_eager_and_ineligible_inputs():
    r, b = runner(enforce_eager=True)
    for _ in range(3):
        r.run(double, torch.ones(1))
    assert b.captures == 0 and r.stats.misses["ineligible"] == 3
    assert not r.capture(double, torch.ones(1))


def test_cpu_runs_eager_with_the_cuda_backend():
    r = GraphRunner("cpu")
    for _ in range(3):
        assert torch.equal(r.run(double, torch.ones(2)), torch.full((2,), 2.0))
    assert r.stats.as_dict()["miss_reasons"]["ineligible"] == 3 and r.stats.hits == 0


def test_warmup_capture_is_outside_max_graphs():
    r, b = runner(max_graphs=1)
    for n in (1, 2, 4):
        assert r.capture(double, torch.ones(n), tag="decode")
    assert r.stats.pinned == 3 and r.stats.graphs == 3
    out = r.run(double, torch.ones(4) * 3, tag="decode")
    assert torch.equal(out, torch.full((4,), 6.0)) and r.stats.hits == 1
    r.run(double, torch.ones(7))
    r.run(double, torch.ones(7))  # the one admitted slot is still free
    assert b.captures == 4
    r0, b0 = runner(max_graphs=0)
    assert r0.capture(double, torch.ones(2))
    r0.run(double, torch.ones(2))
    r0.run(double, torch.ones(3))
    r0.run(double, torch.ones(3))
    assert r0.stats.hits == 1 and r0.stats.misses["ineligible"] == 2 and b0.captures == 1


def test_warmup_capture_respects_memory_floor():
    r, b = runner(min_free_bytes=10, free=5)
    assert not r.capture(double, torch.ones(1))
    assert b.captures == 0


def test_miss_callbacks():
    seen = []
    b = FakeBackend()
    r = GraphRunner("e", GraphConfig(), b, on_replay=lambda: seen.append("replay"), on_miss=seen.append)
    r.run(double, torch.ones(1))
    r.run(double, torch.ones(1))
    assert seen == ["warmup", "replay"]


def test_config_validation():
    with pytest.raises(ValueError):
        GraphConfig(min_capture_calls=1)
    with pytest.raises(ValueError):
        GraphConfig(max_graphs=-1)
