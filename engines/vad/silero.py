"""Voice activity detection: Silero VAD v6 on onnxruntime, batched across sessions.

The model is the `silero_vad.onnx` file shipped in the `silero-vad` wheel, run
on onnxruntime (importing `silero_vad` would import torch) as the batch-wide
graph `silero_graph` builds from its weights. It takes one 32 ms window (512
samples at 16 kHz) per row, preceded by the last 64 samples of that stream's
previous window, plus a recurrent state of [2, batch, 128]; it returns a
speech probability per row and the next state. This is what
`silero_vad.utils_vad.OnnxWrapper` does at 16 kHz, but with each row
belonging to a different stream.

A `VadStream` holds one stream's state row and context. `step_blocks()` takes
each stream's next windows as one block and runs them in rounds (round k holds
the k-th window of every block that has one, one onnxruntime call per round),
so the result equals processing each stream's windows in order; every row's
new state and context go back to its stream. `step()` does the same for a
list of single windows.
A large round is split over `parallel_runs` concurrent single-threaded runs of
the one onnxruntime session (rows are independent): two half-batch runs take
less wall time than one run on two intra-op threads (BENCHMARKS.md).
The caller must not step one stream from two threads at once.
"""

from __future__ import annotations

import importlib.resources
import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from rtmedia.engines.base import EngineError
from rtmedia.engines.vad.silero_graph import batched_model

SAMPLE_RATE = 16000
WINDOW = 512  # samples per window: 32 ms at 16 kHz
WINDOW_MS = WINDOW * 1000 // SAMPLE_RATE
CONTEXT = 64  # samples of the previous window prepended to each window
STATE_SHAPE = (2, 128)  # one stream's row of the model's [2, batch, 128] state
MIN_SPLIT_ROWS = 32  # a round is split only into runs of at least this many rows


def model_path() -> str:
    """Path of the Silero VAD ONNX model inside the installed `silero-vad` wheel."""
    return str(importlib.resources.files("silero_vad") / "data" / "silero_vad.onnx")


class VadStream:
    """One stream's recurrent state row [2, 128] and 64-sample context (float32)."""

    __slots__ = ("context", "state")

    def __init__(self) -> None:
        self.state = np.zeros(STATE_SHAPE, np.float32)
        self.context = np.zeros(CONTEXT, np.float32)

    def reset(self) -> None:
        """Forget the stream's history, as at the start of a new stream."""
        self.state.fill(0.0)
        self.context.fill(0.0)


@dataclass(frozen=True, slots=True)
class VadItem:
    """One 512-sample float32 window (16 kHz, in [-1, 1]) of a stream."""

    stream: VadStream
    window: np.ndarray


def _describe(x: Any) -> str:
    return f"shape {getattr(x, 'shape', None)} {getattr(x, 'dtype', type(x).__name__)}"


def _check(item: Any) -> np.ndarray:
    """The item's window as float32 [512]; ValueError says what is wrong."""
    if not isinstance(item, VadItem) or not isinstance(item.stream, VadStream):
        raise ValueError(f"VAD items must be VadItem(VadStream, window), got {type(item).__name__}")
    w = item.window
    if not isinstance(w, np.ndarray) or w.shape != (WINDOW,) or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"VAD window must be {WINDOW} float samples, shape ({WINDOW},); got {_describe(w)}")
    return w.astype(np.float32, copy=False)


def _check_block(stream: Any, block: Any) -> np.ndarray:
    """The block as float32 of whole windows; ValueError says what is wrong."""
    if type(block) is np.ndarray and block.dtype == np.float32 and block.ndim == 1 and len(block) \
            and not len(block) % WINDOW and type(stream) is VadStream:  # the VAD tick's path
        return block
    if not isinstance(stream, VadStream):
        raise ValueError(f"VAD blocks must be (VadStream, samples), got {type(stream).__name__}")
    if (not isinstance(block, np.ndarray) or block.ndim != 1 or not len(block) or len(block) % WINDOW
            or not np.issubdtype(block.dtype, np.floating)):
        raise ValueError(f"a VAD block must be a whole number of {WINDOW}-sample windows of float samples; "
                         f"got {_describe(block)}")
    return block.astype(np.float32, copy=False)


class VadEngine:
    """Silero VAD behind the engine protocol; `step` returns one speech probability per item."""

    name = "vad"

    def __init__(self, intra_op_threads: int = 1, parallel_runs: int = 1) -> None:
        if intra_op_threads < 0:
            raise ValueError(f"intra_op_threads must be >= 0, got {intra_op_threads}")
        if parallel_runs < 1:
            raise ValueError(f"parallel_runs must be >= 1, got {parallel_runs}")
        self._threads = intra_op_threads
        self._runs = parallel_runs
        self._pool: ThreadPoolExecutor | None = None  # the extra runs' threads, while loaded
        self._session: Any = None
        self._lock = threading.Lock()

    def load(self) -> None:
        import onnxruntime

        with self._lock:
            if self._session is not None:
                return
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = self._threads
            options.inter_op_num_threads = 1
            # Idle worker threads sleep instead of spinning: the cores are shared with other engines.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = onnxruntime.InferenceSession(
                batched_model(model_path()), sess_options=options, providers=["CPUExecutionProvider"]
            )
            if self._runs > 1:
                self._pool = ThreadPoolExecutor(self._runs - 1, "vad-run")

    def warmup(self) -> None:
        self.load()
        streams = [self.open_stream() for _ in range(8)]
        silence = np.zeros(WINDOW, np.float32)
        self.step([VadItem(s, silence) for s in streams])
        self.step_unbatched([VadItem(streams[0], silence)])

    def close(self) -> None:
        with self._lock:
            self._session, pool, self._pool = None, self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def open_stream(self) -> VadStream:
        return VadStream()

    def close_stream(self, stream: VadStream) -> None:
        """Nothing to free: a stream's state lives in its handle."""

    def step(self, items: Sequence[VadItem]) -> list[float]:
        """Speech probability of each item's window; a stream's items run in their order."""
        windows = [_check(item) for item in items]
        per_stream: dict[int, tuple[VadStream, list[int]]] = {}
        for i, item in enumerate(items):
            per_stream.setdefault(id(item.stream), (item.stream, []))[1].append(i)
        groups = list(per_stream.values())
        blocks = [(stream, np.concatenate([windows[i] for i in idx])) for stream, idx in groups]
        probs = [0.0] * len(items)
        for (_, idx), p in zip(groups, self.step_blocks(blocks), strict=True):
            for i, prob in zip(idx, p.tolist(), strict=True):
                probs[i] = prob
        return probs

    def step_blocks(self, blocks: Sequence[tuple[VadStream, np.ndarray]]) -> list[np.ndarray]:
        """Each block is one stream's next k windows (k * 512 samples, k >= 1, a stream at most
        once); returns each block's k speech probabilities. Round r runs the r-th window of
        every block that has one, in one onnxruntime call."""
        session = self._loaded()
        samples = [_check_block(stream, block) for stream, block in blocks]
        if len({id(stream) for stream, _ in blocks}) != len(blocks):
            raise ValueError("a stream may have only one block per step; join its windows into one block")
        counts = [len(x) // WINDOW for x in samples]
        order = sorted(range(len(blocks)), key=counts.__getitem__, reverse=True)  # round r's rows: a prefix
        n, most = len(order), max(counts, default=0)
        audio = np.zeros((n, CONTEXT + most * WINDOW), np.float32)  # per row: context, then the windows
        state = np.empty((2, n, STATE_SHAPE[1]), np.float32)
        for row, i in enumerate(order):
            stream = blocks[i][0]
            audio[row, :CONTEXT] = stream.context
            audio[row, CONTEXT:CONTEXT + len(samples[i])] = samples[i]
            state[:, row] = stream.state
        probs = np.empty((n, most), np.float32)
        rows_with = np.array([counts[i] for i in order])
        for r in range(most):
            rows = int(np.count_nonzero(rows_with > r))
            x = np.ascontiguousarray(audio[:rows, r * WINDOW:r * WINDOW + CONTEXT + WINDOW])
            out, state[:, :rows] = self._run(session, x, np.ascontiguousarray(state[:, :rows]))
            probs[:rows, r] = out[:, 0]
        result = [np.empty(0, np.float32)] * n
        for row, i in enumerate(order):
            stream, k = blocks[i][0], counts[i]
            stream.state[...] = state[:, row]
            stream.context[...] = audio[row, k * WINDOW:k * WINDOW + CONTEXT]
            result[i] = probs[row, :k]
        return result

    def _run(self, session: Any, x: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One round: a single run, or `parallel_runs` concurrent runs over slices of its rows."""
        parts, pool = min(self._runs, len(x) // MIN_SPLIT_ROWS), self._pool
        if parts < 2 or pool is None:
            return session.run(None, {"input": x, "state": state})
        bounds = np.linspace(0, len(x), parts + 1).astype(int).tolist()
        feeds = [{"input": x[a:b], "state": np.ascontiguousarray(state[:, a:b])}
                 for a, b in itertools.pairwise(bounds)]
        futures = [pool.submit(session.run, None, feed) for feed in feeds[1:]]
        results = [session.run(None, feeds[0])] + [f.result() for f in futures]
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results], axis=1)

    def step_unbatched(self, items: Sequence[VadItem]) -> list[float]:
        """The same results as `step`, with one onnxruntime call per item (a baseline)."""
        windows = [_check(item) for item in items]
        session = self._loaded()
        probs = []
        for item, w in zip(items, windows, strict=True):
            s = item.stream
            x = np.concatenate([s.context, w])[None]
            out, state_n = session.run(None, {"input": x, "state": s.state[:, None]})
            s.state[...] = state_n[:, 0]
            s.context[...] = w[-CONTEXT:]
            probs.append(float(out[0, 0]))
        return probs

    def _loaded(self) -> Any:
        session = self._session
        if session is None:
            raise EngineError("VAD engine is not loaded")
        return session
