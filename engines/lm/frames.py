"""Frame-synchronous LM stepping: every active session advances one token per tick.

Full-duplex speech models (Moshi-style) run one LM step per audio frame for
every open session, whether it speaks or listens: at 80 ms frames a GPU must
finish the batched decode step of all sessions within each 80 ms tick, or
every session falls behind real time. `FrameClock` runs that schedule on an
`LmEngine`: sessions `join()` (a slot and a short prompt) and `leave()` at any
time; the change applies at the next tick; each tick is ONE padded batched
decode of all active sessions with absolute deadlines (start + k * tick), so
one slow tick does not shift the clock. A tick whose step ends after its
deadline is late. A session that reaches the context wraps back to its
prompt (truncate), as a long call would slide its window.

`capacity()` finds the most sessions that stay real time: step p99 within the tick.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtmedia.engines.base import EngineError

PROMPT_TOKENS = 8


@dataclass
class FrameReport:
    tick_s: float
    ticks: int = 0
    late: int = 0
    steps_s: list[float] = field(default_factory=list)
    sessions: list[int] = field(default_factory=list)  # active sessions per tick

    def percentile(self, q: float) -> float:
        if not self.steps_s:
            return 0.0
        ordered = sorted(self.steps_s)
        return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]

    @property
    def realtime(self) -> bool:
        return bool(self.steps_s) and self.percentile(99) <= self.tick_s

    def as_dict(self) -> dict[str, Any]:
        return {"tick_ms": self.tick_s * 1000, "ticks": self.ticks, "late_ticks": self.late,
                "sessions_max": max(self.sessions, default=0),
                "step_ms_p50": round(self.percentile(50) * 1000, 3),
                "step_ms_p99": round(self.percentile(99) * 1000, 3),
                "step_ms_max": round(max(self.steps_s, default=0.0) * 1000, 3), "realtime": self.realtime}


class FrameClock:
    """Steps every joined session once per tick on `engine` (see the module docstring)."""

    def __init__(self, engine: Any, tick_s: float = 0.08, vocab: int | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if tick_s <= 0:
            raise ValueError(f"tick must be positive, got {tick_s}")
        self.engine, self.tick_s = engine, tick_s
        self.vocab = vocab or engine.model.config.vocab_size
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._pending: list[tuple[str, int, int]] = []  # ("join" | "leave", slot, first token)
        self._next: dict[int, int] = {}  # slot -> token to feed at the next tick
        self.steps: dict[int, int] = {}  # slot -> ticks it was stepped (since it joined)

    @property
    def active(self) -> list[int]:
        with self._lock:
            return sorted(self._next)

    def join(self) -> int:
        """A new session: its slot (stepped from the next tick on). EngineError when slots are out."""
        slot = self.engine.acquire()
        if slot is None:
            raise EngineError("no free LM slot")
        prompt = [(slot * 31 + i * 7) % self.vocab for i in range(PROMPT_TOKENS)]
        logits = self.engine.prefill(slot, prompt)
        with self._lock:
            self._pending.append(("join", slot, int(logits.argmax())))
        return slot

    def leave(self, slot: int) -> None:
        """The session ends at the next tick boundary (its slot is freed then)."""
        with self._lock:
            self._pending.append(("leave", slot, 0))

    def tick(self) -> float:
        """Apply joins/leaves, then one decode of every active session; the step's seconds."""
        with self._lock:
            for what, slot, token in self._pending:
                if what == "join":
                    self._next[slot] = token
                    self.steps[slot] = 0
                else:
                    self._next.pop(slot, None)
                    self.steps.pop(slot, None)
                    self.engine.release(slot)
            self._pending.clear()
            batch = dict(self._next)
        start = self._clock()
        if batch:
            for slot in batch:
                if self.engine.length(slot) >= self.engine.context:
                    self.engine.truncate(slot, PROMPT_TOKENS)
            out = self.engine.decode(batch)
            with self._lock:
                for slot, logits in out.items():
                    if slot in self._next:
                        self._next[slot] = int(logits.argmax())
                        self.steps[slot] += 1
        return self._clock() - start

    def run(self, ticks: int, on_tick: Callable[[int], None] | None = None) -> FrameReport:
        """`ticks` ticks on the absolute schedule; `on_tick(k)` runs before tick k (joins, leaves).
        A tick is late when its decode ends after the next tick's deadline."""
        report = FrameReport(self.tick_s)
        start = self._clock()
        for k in range(ticks):
            deadline = start + k * self.tick_s
            if on_tick is not None:  # joins prefill in the slack before the tick
                on_tick(k)
            wait = deadline - self._clock()
            if wait > 0:
                self._sleep(wait)
            report.steps_s.append(self.tick())
            report.sessions.append(len(self._next))
            report.ticks += 1
            if self._clock() > deadline + self.tick_s:
                report.late += 1
        return report

    def close(self) -> None:
        with self._lock:
            slots = set(self._next) | {s for what, s, _ in self._pending if what == "join"}
            self._next.clear()
            self._pending.clear()
            self.steps.clear()
        for slot in slots:
            self.engine.release(slot)


def capacity(engine: Any, tick_s: float = 0.08, counts: Sequence[int] | None = None, ticks: int = 20,
             vocab: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """The most sessions (of `counts`, ascending, default the engine's batch sizes) whose step p99 stays
    within the tick, and the report per count tried; stops at the first count that misses."""
    counts = sorted(counts or engine.batch_sizes)
    best, tried = 0, []
    for n in counts:
        if n > engine.slots_total:
            break
        clock = FrameClock(engine, tick_s, vocab)
        try:
            for _ in range(n):
                clock.join()
            clock.tick()  # the joins apply; not measured
            report = clock.run(ticks)
        finally:
            clock.close()
        tried.append({"sessions": n, **report.as_dict()})
        if not report.realtime:
            break
        best = n
    return best, tried
