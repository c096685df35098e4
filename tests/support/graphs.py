"""A stand-in for the CUDA-graph backend, for unit tests of the graph runner and the engines on it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def decode_all(engine: Any, latent: torch.Tensor) -> list[np.ndarray]:
    """Every chunk of a causal-plan decode of `latent` on a VideoEngine, step by step."""
    from rtmedia.engines.video.plan import causal_plan

    stream = engine.open_stream(latent, causal_plan(latent.shape[1]), 0, 0)
    try:
        return [engine.decode_step(stream) for _ in stream.plan.steps]
    finally:
        engine.close_stream(stream)


class FakeBackend:
    """Capture runs `fn` once on the static inputs and keeps its outputs; replay recomputes
    from the static inputs into those same output tensors (what a CUDA graph does)."""

    def __init__(self, free: int = 1 << 40) -> None:
        self.free = free
        self.captures = self.replays = 0
        self.pools: list[object] = []
        self.pool_of_capture: list[object] = []
        self.fail: BaseException | None = None

    def eligible(self, inputs):
        return bool(inputs)

    def stream(self, device):
        return "stream-0"

    def free_bytes(self, device):
        return self.free

    def new_pool(self, device):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, fn, inputs, pool):
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        self.pool_of_capture.append(pool)
        out = fn(*inputs)
        return (fn, inputs, out), out

    def replay(self, graph):
        fn, inputs, out = graph
        self.replays += 1
        new = fn(*inputs)
        for o, n in zip(*(((x,) if isinstance(x, torch.Tensor) else x) for x in (out, new)), strict=True):
            o.copy_(n)
