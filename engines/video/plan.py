"""Frame plans and the chunk assembler for chunked video decode (docs/protocol.md#chunk-contract,
docs/protocol.md#causal-plan, docs/protocol.md#overlapped-window-plan).

Pure functions and numpy only: no torch, no gRPC.

A plan lists the decode *steps* (one latent frame each, run by the engine with
a feature cache that is fresh at the start of every *segment*) and the
*chunks* the client receives. The assembler turns the frames of each step into
committed chunks, in order, and holds the final chunk back until the whole
plan has been checked.

- causal (Wan-style, docs/protocol.md#causal-plan): one segment, the whole latent; latent frame 0
  gives 1 frame, each later one 4; a chunk is the frames of
  `steps_per_chunk` latent steps.
- overlapped (MiniMax-H3-style, docs/protocol.md#overlapped-window-plan): the latent, padded at the end by
  repeating its last frame, is cut into windows of 7 tokens advancing by 5;
  each window is its own segment (fresh cache) and decodes to 25 frames, of
  which the 3 leading ones are dropped; the first 5 of the remaining 22 are
  blended linearly with the 5 held back from the previous window; the window
  commits its first 17 frames as one chunk and holds its last 5. The 5 held
  after the last window are the final chunk: 17·N + 5 frames in N + 1 chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TEMPORAL_RATIO = 4


class PlanError(ValueError):
    """The latent cannot be decoded with the requested plan."""


class LatentTooShort(PlanError):
    """The latent has fewer frames than the plan needs."""


@dataclass(frozen=True)
class Step:
    """Decode latent frame `index` (of the padded latent) in the segment [start, stop)."""

    start: int
    stop: int
    index: int

    @property
    def fresh(self) -> bool:
        """The first step of its segment: the feature cache starts empty."""
        return self.index == self.start

    @property
    def frames(self) -> int:
        return 1 if self.fresh else TEMPORAL_RATIO


@dataclass(frozen=True)
class Chunk:
    index: int
    frame_start: int
    frame_count: int

    @property
    def frame_stop(self) -> int:
        return self.frame_start + self.frame_count


@dataclass(frozen=True)
class OverlapConfig:
    """The reference configuration of the overlapped window plan (docs/protocol.md#overlapped-window-plan)."""

    advance: int = 5        # latent tokens a window moves on
    overlap: int = 2        # latent tokens shared by neighbouring windows
    drop_leading: int = 3   # decoded frames dropped at the start of each window
    blend: int = 5          # frames blended linearly at each window boundary

    @property
    def window(self) -> int:
        return self.advance + self.overlap

    @property
    def window_frames(self) -> int:
        return 1 + TEMPORAL_RATIO * (self.window - 1)

    @property
    def split(self) -> int:
        """Frames a window commits."""
        return self.window_frames - self.drop_leading - self.blend


OVERLAP = OverlapConfig()


@dataclass(frozen=True)
class FramePlan:
    kind: str                   # "causal" or "overlapped"
    latent_frames: int          # T of the request
    padded_frames: int          # T plus the repeated last frames the windows need
    steps: tuple[Step, ...]
    chunks: tuple[Chunk, ...]
    overlap: OverlapConfig | None = None

    @property
    def total_frames(self) -> int:
        return self.chunks[-1].frame_stop

    @property
    def total_chunks(self) -> int:
        return len(self.chunks)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return sorted({(s.start, s.stop) for s in self.steps})

    def one_shot(self) -> FramePlan:
        """The same decode delivered as one chunk."""
        return FramePlan(self.kind, self.latent_frames, self.padded_frames, self.steps,
                         (Chunk(0, 0, self.total_frames),), self.overlap)


def causal_frames(latent_frames: int) -> int:
    """Output frames of a causal decode: 1 + 4 (T - 1)."""
    return 1 + TEMPORAL_RATIO * (latent_frames - 1)


def causal_plan(latent_frames: int, steps_per_chunk: int = 1) -> FramePlan:
    if latent_frames < 1:
        raise LatentTooShort(f"the latent has {latent_frames} frames; the causal plan needs at least 1")
    if steps_per_chunk < 1:
        raise PlanError(f"latent_steps_per_chunk={steps_per_chunk} must be at least 1")
    t = latent_frames
    steps = tuple(Step(0, t, i) for i in range(t))
    chunks = []
    frame = 0
    for n, first in enumerate(range(0, t, steps_per_chunk)):
        count = sum(s.frames for s in steps[first:first + steps_per_chunk])
        chunks.append(Chunk(n, frame, count))
        frame += count
    return FramePlan("causal", t, t, steps, tuple(chunks))


def overlapped_windows(latent_frames: int, cfg: OverlapConfig = OVERLAP) -> tuple[int, int]:
    """(N windows, padding tokens) by docs/protocol.md#overlapped-window-plan; N <= 0 is rejected."""
    pseudo = latent_frames + cfg.drop_leading
    pad_tok = (cfg.advance - pseudo % cfg.advance) % cfg.advance
    n = (pseudo + pad_tok) // cfg.advance - 1
    if n <= 0:
        raise LatentTooShort(f"the latent has {latent_frames} frames; the overlapped plan needs at least 3")
    return n, pad_tok


def overlapped_plan(latent_frames: int, cfg: OverlapConfig = OVERLAP) -> FramePlan:
    n, pad_tok = overlapped_windows(latent_frames, cfg)
    padded = latent_frames + pad_tok
    steps = []
    for k in range(n):
        start = k * cfg.advance
        steps += [Step(start, start + cfg.window, start + j) for j in range(cfg.window)]
    if steps[-1].stop != padded:
        raise AssertionError(f"windows cover {steps[-1].stop} tokens, the padded latent has {padded}")
    chunks = [Chunk(k, k * cfg.split, cfg.split) for k in range(n)]
    chunks.append(Chunk(n, n * cfg.split, cfg.blend))
    return FramePlan("overlapped", latent_frames, padded, tuple(steps), tuple(chunks), cfg)


def make_plan(kind: str, latent_frames: int, steps_per_chunk: int = 1) -> FramePlan:
    if kind == "causal":
        return causal_plan(latent_frames, steps_per_chunk)
    if kind == "overlapped":
        if steps_per_chunk != 1:
            raise PlanError("latent_steps_per_chunk applies to the causal plan only (a window is one chunk)")
        return overlapped_plan(latent_frames)
    raise PlanError(f"unknown frame plan {kind!r}; known: causal, overlapped")


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """float [0, 1] -> uint8, rounded; always a new array."""
    return np.rint(np.clip(frames, 0.0, 1.0) * 255.0).astype(np.uint8)


def blend(held: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Linear cross-fade over the overlap: weights of the new window rise (i + 0.5) / n."""
    n = len(held)
    w = ((np.arange(n, dtype=np.float32) + 0.5) / n).reshape(n, 1, 1, 1)
    return (1.0 - w) * held + w * head


@dataclass(frozen=True)
class ChunkFrames:
    chunk: Chunk
    total_chunks: int
    is_final: bool
    frames: np.ndarray  # uint8 T x H x W x 3, owned


class Assembler:
    """Turns step frames (float [0, 1], T x H x W x 3) into committed chunks.

    `push(frames)` takes the frames of the next step of the plan and returns the
    non-final chunks that became complete; `finish()` checks the whole plan and
    returns the final chunk. Every chunk is an owned uint8 copy."""

    def __init__(self, plan: FramePlan) -> None:
        self.plan = plan
        self._step = 0
        self._pending: list[np.ndarray] = []   # committed frames not yet in a chunk (uint8)
        self._pending_frames = 0
        self._window: list[np.ndarray] = []    # overlapped: float frames of the current window
        self._held: np.ndarray | None = None   # overlapped: float frames held for blending
        self._next_chunk = 0
        self._frames_out = 0
        self._final: ChunkFrames | None = None
        self._finished = False
        self._shape: tuple[int, ...] | None = None

    def push(self, frames: np.ndarray) -> list[ChunkFrames]:
        if self._finished:
            raise AssertionError("push after finish")
        if self._step >= len(self.plan.steps):
            raise AssertionError(f"the plan has {len(self.plan.steps)} steps; got one more")
        step = self.plan.steps[self._step]
        if frames.ndim != 4 or frames.shape[0] != step.frames or frames.shape[3] != 3:
            raise AssertionError(f"step {self._step} should give {step.frames} frames, got shape {frames.shape}")
        if self._shape is None:
            self._shape = frames.shape[1:]
        elif frames.shape[1:] != self._shape:
            raise AssertionError(f"frame size changed from {self._shape} to {frames.shape[1:]}")
        self._step += 1
        if self.plan.overlap is None:
            self._commit(to_uint8(frames))
        else:
            self._window.append(frames)
            if self._step == len(self.plan.steps) or self.plan.steps[self._step].fresh:
                self._close_window(self.plan.overlap)
        return self._emit()

    def _close_window(self, cfg: OverlapConfig) -> None:
        window = np.concatenate(self._window)[cfg.drop_leading:]
        self._window = []
        if len(window) != cfg.split + cfg.blend:
            raise AssertionError(f"a window gave {len(window)} frames after dropping, expected "
                                 f"{cfg.split + cfg.blend}")
        if self._held is not None:
            window = np.concatenate([blend(self._held, window[:cfg.blend]), window[cfg.blend:]])
        self._commit(to_uint8(window[:cfg.split]))
        self._held = window[cfg.split:]
        if self._step == len(self.plan.steps):
            self._commit(to_uint8(self._held))
            self._held = None

    def _commit(self, frames: np.ndarray) -> None:
        self._pending.append(frames)
        self._pending_frames += len(frames)

    def _emit(self) -> list[ChunkFrames]:
        out = []
        while self._next_chunk < self.plan.total_chunks:
            chunk = self.plan.chunks[self._next_chunk]
            if chunk.frame_start != self._frames_out:
                raise AssertionError(f"chunk {chunk.index} starts at {chunk.frame_start}, sent {self._frames_out}")
            if self._pending_frames < chunk.frame_count:
                break
            data = np.concatenate(self._pending)
            frames, rest = data[:chunk.frame_count].copy(), data[chunk.frame_count:]
            self._pending = [rest] if len(rest) else []
            self._pending_frames = len(rest)
            final = chunk.index == self.plan.total_chunks - 1
            ready = ChunkFrames(chunk, self.plan.total_chunks, final, frames)
            self._next_chunk += 1
            self._frames_out += chunk.frame_count
            if final:
                self._final = ready  # held until finish() has checked the plan
            else:
                out.append(ready)
        return out

    def finish(self) -> ChunkFrames:
        """The final chunk, once every step, frame and chunk of the plan is accounted for."""
        problems = []
        if self._step != len(self.plan.steps):
            problems.append(f"{self._step} of {len(self.plan.steps)} steps decoded")
        if self._pending_frames or self._held is not None or self._window:
            problems.append("frames left over after the last chunk")
        if self._frames_out != self.plan.total_frames:
            problems.append(f"{self._frames_out} frames assembled, the plan has {self.plan.total_frames}")
        if self._next_chunk != self.plan.total_chunks or self._final is None:
            problems.append(f"{self._next_chunk} of {self.plan.total_chunks} chunks assembled")
        if problems:
            raise AssertionError("frame plan check failed: " + "; ".join(problems))
        self._finished = True
        assert self._final is not None
        return self._final


def check_chunks(chunks: Sequence[tuple[int, int, int, int, bool]], total_frames: int | None = None) -> None:
    """Check the chunk contract (docs/protocol.md#chunk-contract) on (chunk_index, total_chunks, frame_start,
    frame_count, is_final) tuples; raises AssertionError naming the first violation."""
    if not chunks:
        raise AssertionError("no chunks")
    total = chunks[0][1]
    frame = 0
    for n, (index, total_chunks, start, count, final) in enumerate(chunks):
        if index != n:
            raise AssertionError(f"chunk {n} has chunk_index {index}")
        if total_chunks != total or total <= 0:
            raise AssertionError(f"chunk {n} has total_chunks {total_chunks}, the first had {total}")
        if start != frame:
            raise AssertionError(f"chunk {n} starts at frame {start}, the previous ended at {frame}")
        if count <= 0:
            raise AssertionError(f"chunk {n} is empty")
        if final != (n == len(chunks) - 1):
            raise AssertionError(f"chunk {n} has is_final={final}")
        frame += count
    if len(chunks) != total:
        raise AssertionError(f"{len(chunks)} chunks arrived, total_chunks says {total}")
    if total_frames is not None and frame != total_frames:
        raise AssertionError(f"{frame} frames arrived, expected {total_frames}")
