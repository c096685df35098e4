"""CUDA-graph runner: capture fixed-shape engine steps once, replay them
(docs/architecture.md#cuda-graph-runner).

A `GraphRunner` belongs to one engine. `run(fn, *inputs)` computes
`fn(*inputs)` (tensors in, a tensor or a tuple of tensors out), either eagerly
or by replaying a CUDA graph captured from `fn` for exactly these input shapes:

- the key is the tag, each input's shape/dtype/device and the current stream;
- a key is captured on its `min_capture_calls`-th call (≥ 2; earlier calls are
  `warmup` misses), at most `max_graphs` per engine (0 disables graphs), no
  eviction: once full, new keys run eagerly (`capacity` misses); the admission
  history (call counts of keys not yet captured) keeps the 4 * `max_graphs`
  most recent keys;
- before a capture, free device memory is checked against `min_free_bytes`;
  below it the call runs eagerly (a `memory` miss) and may be admitted later;
- static input buffers are allocated outside capture; a replay copies the new
  inputs into them, and the returned outputs are clones (they survive later
  replays);
- the graphs of one engine on one stream share one memory pool;
- a capture failure is fatal for the runner: the original exception
  propagates, later calls raise `GraphRunnerFailed` without retrying, and
  `capture_failures` records it (recovery is a worker restart); with
  `eager_after_failure` the failed call and every later one run eagerly
  instead (`failed` misses), so a failure never fails a request;
- `enforce_eager`, CPU tensors, no tensor inputs, or `max_graphs` 0 for a key
  not captured at warm-up: eager, an `ineligible` miss.

`capture(fn, *inputs)` is the warm-up path (the LM decode step's fixed batch
sizes): it captures at once, outside admission and `max_graphs`.

The CUDA calls go through a backend (`CudaGraphBackend`); tests give the
runner another one to check the bookkeeping on a CPU.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

MISS_REASONS = ("ineligible", "capacity", "warmup", "memory", "failed")
GiB = 1 << 30


class GraphRunnerFailed(RuntimeError):
    """A capture failed earlier; the runner no longer runs anything (restart the worker)."""


@dataclass(frozen=True)
class GraphConfig:
    max_graphs: int = 4
    min_capture_calls: int = 2
    min_free_bytes: int = GiB
    enforce_eager: bool = False
    eager_after_failure: bool = False  # a failed capture: eager from then on, instead of raising

    def __post_init__(self) -> None:
        if self.max_graphs < 0 or self.min_capture_calls < 2 or self.min_free_bytes < 0:
            raise ValueError(f"need max_graphs >= 0, min_capture_calls >= 2, min_free_bytes >= 0: {self}")


@dataclass
class GraphStats:
    hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    graphs: int = 0
    pinned: int = 0
    captures: int = 0
    capture_failures: list[str] = field(default_factory=list)

    @property
    def miss_total(self) -> int:
        return sum(self.misses.values())

    @property
    def hit_rate(self) -> float:
        calls = self.hits + self.miss_total
        return self.hits / calls if calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.miss_total, "hit_rate": round(self.hit_rate, 4),
                "graphs": self.graphs, "pinned": self.pinned, "captures": self.captures,
                "miss_reasons": dict(self.misses), "capture_failures": list(self.capture_failures)}


class CaptureBackend(Protocol):
    """The device side of the runner."""

    def eligible(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether these inputs can run in a graph at all (e.g. all on one CUDA device)."""

    def stream(self, device: torch.device) -> Hashable:
        """The current stream of the device (part of the key; one pool per stream)."""

    def free_bytes(self, device: torch.device) -> int:
        """Free device memory now."""

    def new_pool(self, device: torch.device) -> Any:
        """A memory pool for the graphs of one engine on one stream."""

    def capture(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor], pool: Any) -> tuple[Any, Any]:
        """Capture `fn(*inputs)`; returns (graph, the static outputs the graph writes)."""

    def replay(self, graph: Any) -> None:
        """Run the captured graph once."""


class CudaGraphBackend:
    """torch.cuda graphs: warm-up on a side stream, capture into a shared pool, replay."""

    def eligible(self, inputs: Sequence[torch.Tensor]) -> bool:
        if not inputs or not torch.cuda.is_available():
            return False
        device = inputs[0].device
        return device.type == "cuda" and all(t.device == device for t in inputs)

    def stream(self, device: torch.device) -> Hashable:
        return torch.cuda.current_stream(device).cuda_stream

    def free_bytes(self, device: torch.device) -> int:
        return torch.cuda.mem_get_info(device)[0]

    def new_pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor], pool: Any) -> tuple[Any, Any]:
        # Lazy initialisation (cuBLAS handles, autotuning) must not happen inside capture.
        side = torch.cuda.Stream(inputs[0].device)
        side.wait_stream(torch.cuda.current_stream(inputs[0].device))
        with torch.cuda.stream(side):
            fn(*inputs)
        torch.cuda.current_stream(inputs[0].device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn(*inputs)
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclass
class _Graph:
    graph: Any
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    single: bool  # fn returned one tensor, not a tuple


def _as_tuple(out: Any) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(out, torch.Tensor):
        return (out,), True
    return tuple(out), False


class GraphRunner:
    """Capture/replay manager of one engine (see the module docstring)."""

    def __init__(self, engine: str, config: GraphConfig | None = None, backend: CaptureBackend | None = None,
                 on_replay: Callable[[], None] | None = None,
                 on_miss: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.config = config or GraphConfig()
        self.backend: CaptureBackend = backend or CudaGraphBackend()
        self.stats = GraphStats()
        self._graphs: dict[Hashable, _Graph] = {}
        self._history: OrderedDict[Hashable, int] = OrderedDict()
        self._pools: dict[Hashable, Any] = {}
        self._failure: BaseException | None = None
        self._on_replay, self._on_miss = on_replay, on_miss
        self._lock = threading.RLock()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def key(self, inputs: Sequence[torch.Tensor], tag: Hashable = None) -> Hashable:
        device = inputs[0].device
        return (tag, self.backend.stream(device),
                tuple((tuple(t.shape), t.dtype, t.device) for t in inputs))

    def eligible(self, inputs: Sequence[torch.Tensor]) -> bool:
        return not self.config.enforce_eager and self.backend.eligible(inputs)

    def has_tag(self, tag: Hashable) -> bool:
        """Whether a graph is captured under `tag` (of any shape)."""
        with self._lock:
            return any(key[0] == tag for key in self._graphs)  # type: ignore[index]

    def run(self, fn: Callable[..., Any], *inputs: torch.Tensor, tag: Hashable = None) -> Any:
        """`fn(*inputs)`, from a graph when one is captured or admitted for this key, else eager.
        One `fn` per tag: a key's graph replays whatever `fn` it was captured from."""
        with self._lock:
            if self._check_failed():
                return self._eager("failed", fn, inputs)
            if not self.eligible(inputs):
                return self._eager("ineligible", fn, inputs)
            key = self.key(inputs, tag)
            entry = self._graphs.get(key)
            if entry is None:
                # max_graphs 0 disables admission; warm-up captures still replay
                reason = "ineligible" if self.config.max_graphs == 0 else self._admit(key, inputs[0].device)
                if reason is not None:
                    return self._eager(reason, fn, inputs)
                try:
                    entry = self._capture(key, fn, inputs, pinned=False)
                except Exception:
                    if not self.config.eager_after_failure:
                        raise
                    log.warning("%s: a CUDA-graph capture failed; it runs eagerly from now on", self.engine,
                                exc_info=True)
                    return self._eager("failed", fn, inputs)
            return self._replay(entry, inputs)

    def eager(self, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        """`fn(*inputs)` eagerly, counted `ineligible`: a step whose shapes are not static."""
        with self._lock:
            return self._eager("failed" if self._check_failed() else "ineligible", fn, inputs)

    def capture(self, fn: Callable[..., Any], *inputs: torch.Tensor, tag: Hashable = None) -> bool:
        """Capture `fn` for these input shapes now (warm-up), outside admission and `max_graphs`.
        False when graphs cannot be used for them (ineligible, below the memory floor, or after a
        failure with `eager_after_failure`)."""
        with self._lock:
            if self._check_failed() or not self.eligible(inputs):
                return False
            key = self.key(inputs, tag)
            if key in self._graphs:
                return True
            if self._below_floor(inputs[0].device):
                return False
            self._capture(key, fn, inputs, pinned=True)
            return True

    def reset(self) -> None:
        """Drop every graph and pool (the engine is closing); a failure stays recorded."""
        with self._lock:
            self._graphs.clear()
            self._history.clear()
            self._pools.clear()
            self.stats.graphs = self.stats.pinned = 0

    # -- internals ---------------------------------------------------------------------------------

    def _check_failed(self) -> bool:
        """Whether a capture failed and calls run eagerly (`eager_after_failure`); raises
        `GraphRunnerFailed` after a failure without it."""
        if self._failure is not None and self.config.eager_after_failure:
            return True
        self._raise_if_failed()
        return False

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise GraphRunnerFailed(f"{self.engine}: CUDA-graph capture failed earlier "
                                    f"({self._failure!r}); restart the worker") from self._failure

    def _admit(self, key: Hashable, device: torch.device) -> str | None:
        """None when the key may be captured now, else the miss reason."""
        unpinned = len(self._graphs) - self.stats.pinned
        if unpinned >= self.config.max_graphs:
            return "capacity"
        calls = self._history.pop(key, 0) + 1
        self._history[key] = calls
        while len(self._history) > 4 * self.config.max_graphs:
            self._history.popitem(last=False)
        if calls < self.config.min_capture_calls:
            return "warmup"
        if self._below_floor(device):
            return "memory"
        del self._history[key]
        return None

    def _below_floor(self, device: torch.device) -> bool:
        floor = self.config.min_free_bytes
        return floor > 0 and self.backend.free_bytes(device) < floor

    def _capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                 pinned: bool) -> _Graph:
        static = tuple(t.detach().clone() for t in inputs)  # allocated outside capture
        stream = key[1]  # type: ignore[index]
        pool = self._pools.get(stream)
        if pool is None:
            pool = self._pools[stream] = self.backend.new_pool(static[0].device)
        try:
            graph, outputs = self.backend.capture(fn, static, pool)
        except BaseException as exc:
            self._failure = exc
            self.stats.capture_failures.append(f"{type(exc).__name__}: {exc}")
            raise
        outs, single = _as_tuple(outputs)
        entry = self._graphs[key] = _Graph(graph, static, outs, single)
        self.stats.graphs = len(self._graphs)
        self.stats.captures += 1
        self.stats.pinned += pinned
        return entry

    def _replay(self, entry: _Graph, inputs: Sequence[torch.Tensor]) -> Any:
        for buffer, value in zip(entry.inputs, inputs, strict=True):
            if buffer.data_ptr() != value.data_ptr():
                buffer.copy_(value)
        self.backend.replay(entry.graph)
        self.stats.hits += 1
        if self._on_replay is not None:
            self._on_replay()
        outs = tuple(t.clone() for t in entry.outputs)
        return outs[0] if entry.single else outs

    def _eager(self, reason: str, fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> Any:
        self.stats.misses[reason] += 1
        if self._on_miss is not None:
            self._on_miss(reason)
        return fn(*inputs)
