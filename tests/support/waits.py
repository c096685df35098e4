"""Waiting on an event or a condition, never on the clock.

A test that sleeps "long enough" and then asserts fails on a slow or busy machine (and wastes
the time on a fast one). These await the thing itself: `until` polls a condition at a short
interval and returns as soon as it holds, failing with a message that names what was awaited
(and what was last seen) once `timeout` passes; `until_sync` is its twin for tests that are
not async. `metric` reads one Prometheus sample, in-process (a server or a registry) or over
HTTP (a /metrics address); `metric_at_least` and `metric_equals` await a sample's presence and
value rather than reading it once: a counter set just after the event a test saw is not
there yet at the moment the test looks.

    await until(lambda: engine.open_streams == 0, what="the streams closing")
    await metric_at_least(server, "rtmedia_asr_worker_restarts_total", 1, worker="0")
"""

from __future__ import annotations

import asyncio
import inspect
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

TIMEOUT_S = 10.0
INTERVAL_S = 0.02


class NotYet(AssertionError):
    """What `until` raises when the condition did not hold within its timeout."""


def _failure(what: str, timeout: float, seen: Callable[[], Any] | None) -> NotYet:
    now = "" if seen is None else f" (last seen: {seen()!r})"
    return NotYet(f"timed out after {timeout:g} s waiting for {what}{now}")


async def until(condition: Callable[[], T | Awaitable[T]], timeout: float = TIMEOUT_S,
                what: str = "the condition", interval: float = INTERVAL_S,
                seen: Callable[[], Any] | None = None) -> T:
    """Await `condition()` (a plain or an async callable) until it is truthy; return its value.
    Fails (NotYet, an AssertionError) naming `what`, and showing `seen()` where given, once
    `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, seen)
        await asyncio.sleep(interval)


def until_sync(condition: Callable[[], T], timeout: float = TIMEOUT_S, what: str = "the condition",
               interval: float = INTERVAL_S, seen: Callable[[], Any] | None = None) -> T:
    """`until` for a test that is not async (or a thread): polls `condition()` with time.sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, seen)
        time.sleep(interval)


async def event(awaitable: Awaitable[T], timeout: float = TIMEOUT_S, what: str = "the event") -> T:
    """Await an event's `wait()`, a future or a task, failing with `what` rather than a bare
    TimeoutError after `timeout` seconds."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise NotYet(f"timed out after {timeout:g} s waiting for {what}") from None


# ---- Prometheus samples ---------------------------------------------------------------------------

def _labelled(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, frozenset], float]:
    """Every sample a /metrics address serves, keyed by (name, frozenset of label items)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(source: Any, name: str, **labels: str) -> float | None:
    """One sample's value now, or None where it is not (yet) there. `source`: a server or a
    scheduler (anything with `.metrics.registry`), a Metrics (`.registry`), a prometheus
    CollectorRegistry, or the address of a /metrics endpoint."""
    if isinstance(source, str):
        try:
            return scrape(source).get((name, frozenset(labels.items())))
        except OSError:
            return None  # not serving yet: the same as not there yet
    registry = getattr(getattr(source, "metrics", None), "registry", None)
    if registry is None:
        registry = getattr(source, "registry", source)
    return registry.get_sample_value(name, labels)


async def metric_at_least(source: Any, name: str, minimum: float, timeout: float = TIMEOUT_S,
                          **labels: str) -> float:
    """Await a sample being there with a value >= `minimum`; return the value."""
    last: list[float | None] = [None]

    def reached() -> bool:
        last[0] = metric(source, name, **labels)
        return last[0] is not None and last[0] >= minimum

    await until(reached, timeout, f"{_labelled(name, labels)} >= {minimum:g}", seen=lambda: last[0])
    return last[0]  # type: ignore[return-value]


async def metric_equals(source: Any, name: str, value: float, timeout: float = TIMEOUT_S, **labels: str) -> float:
    """Await a sample being there with exactly `value` (a gauge settling); return it."""
    last: list[float | None] = [None]

    def reached() -> bool:
        last[0] = metric(source, name, **labels)
        return last[0] == value

    await until(reached, timeout, f"{_labelled(name, labels)} == {value:g}", seen=lambda: last[0])
    return value
