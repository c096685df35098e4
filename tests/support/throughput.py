"""Batched against one-by-one engine steps, in CPU time: the ratio the unit tests assert
(tests/unit/test_vad.py, tests/unit/test_lm_engine.py) and tests/perf/bench_batching.py reports.

CPU time of this process (`time.process_time`), not wall time, and the best of rounds taken in
turn (A B B A ...): time the process spends waiting for a core on a loaded machine is not
counted, and a slow stretch of time does not fall on one side only."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np


def cpu_seconds(run: Callable[[], object], calls: int) -> float:
    """CPU seconds of this process per call of `run`, over `calls` calls."""
    start = time.process_time()
    for _ in range(calls):
        run()
    return (time.process_time() - start) / calls


def best_of(rounds: int, **measures: Callable[[], float]) -> dict[str, float]:
    """The least result of each measure over `rounds` rounds; a round runs every measure, in
    the reverse order of the round before."""
    names = list(measures)
    best = dict.fromkeys(names, math.inf)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            best[name] = min(best[name], measures[name]())
    return best


def vad_windows(sessions: int, seed: int = 0) -> list[Any]:
    """One 32 ms window of noise for each of `sessions` new VAD streams."""
    from rtmedia.engines.vad.silero import WINDOW, VadItem, VadStream

    rng = np.random.default_rng(seed)
    return [VadItem(VadStream(), rng.normal(0, 0.1, WINDOW).astype(np.float32)) for _ in range(sessions)]


@contextmanager
def decoding_slots(engine: Any, sessions: int, vocab_size: int, prompt_tokens: int = 32) -> Iterator[dict[int, int]]:
    """`sessions` slots of an LmEngine, each prefilled with its own random prompt: {slot: next
    token} for `engine.decode`; the slots are released at exit."""
    import torch

    slots: list[int] = []
    try:
        for seed in range(sessions):
            slot = engine.acquire()
            assert slot is not None, "not enough free slots"
            slots.append(slot)
            g = torch.Generator().manual_seed(seed)
            engine.prefill(slot, torch.randint(1, vocab_size, (prompt_tokens,), generator=g).tolist())
        yield dict.fromkeys(slots, 5)
    finally:
        for slot in slots:
            engine.release(slot)


def decode_cpu_per_token(engine: Any, tokens: dict[int, int], steps: int) -> tuple[Callable[[], float], ...]:
    """Two measures of CPU seconds per generated token for the sessions in `tokens`: one batched
    decode call per step, and one decode call per session per step."""

    def batched() -> float:
        return cpu_seconds(lambda: engine.decode(tokens), steps) / len(tokens)

    def one_by_one() -> float:
        return cpu_seconds(lambda: [engine.decode({slot: t}) for slot, t in tokens.items()], steps) / len(tokens)

    return batched, one_by_one
