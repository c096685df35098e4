"""rtmedia_threads{pool} (docs/operations.md#metrics): the process's threads by the pool that
started them, so a thread count off its baseline names what grew."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from rtmedia.server.metrics import Metrics, thread_pool


@pytest.mark.parametrize(("name", "pool"), [
    ("asyncio_3", "asyncio"), ("vad-run_1", "vad-run"), ("engine-tts-0_0", "engine-tts-0"),
    ("tick-vad_0", "tick-vad"), ("Thread-7 (serve)", "Thread (serve)"), ("MainThread", "MainThread"),
    ("ThreadPoolExecutor-2_5", "ThreadPoolExecutor-2"),
])
def test_a_thread_is_counted_under_its_pool(name, pool):
    assert thread_pool(name) == pool


def threads(metrics: Metrics) -> dict[str, float]:
    family = next(f for f in metrics.registry.collect() if f.name == "rtmedia_threads")
    return {s.labels["pool"]: s.value for s in family.samples}


def test_a_pool_shows_its_threads_as_it_starts_them_and_native_threads_apart():
    metrics = Metrics()
    before = threads(metrics)
    assert before["MainThread"] == 1
    started, release = threading.Barrier(4), threading.Event()
    with ThreadPoolExecutor(3, thread_name_prefix="probe-pool") as pool:
        for _ in range(3):
            pool.submit(lambda: (started.wait(), release.wait()))
        started.wait()
        during, total = threads(metrics), len(list(Path("/proc/self/task").iterdir()))
        text = generate_latest(metrics.registry)
        release.set()
    assert during["probe-pool"] == 3 and "probe-pool" not in before
    assert b'rtmedia_threads{pool="probe-pool"} 3.0' in text
    assert during["native"] >= 0 and sum(during.values()) == pytest.approx(total, abs=2)  # others come and go
    assert "probe-pool" not in threads(metrics)  # the pool shut down: its threads are gone
