"""Kernel dispatch: run a Triton kernel inside its contract, its torch reference twin outside it.

A `Dispatcher` pairs a kernel with its reference and a contract check. A call
whose inputs are outside the contract (wrong dtype, layout, size, device, no
Triton) runs the reference and counts why. A kernel launch that raises runs
the reference too, and its key (the shapes, dtypes and device the contract
names) is remembered, so that key never launches again. Triton runs on CUDA
tensors, or on CPU tensors under its interpreter (`TRITON_INTERPRET=1`, read
when the kernels are first loaded: that is how the tests check the kernels on
a machine without a GPU).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ELEMENTS = 2**31 - 1  # the kernels index with int32


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_missing() -> str | None:
    """Why Triton cannot run here at all, or None."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return "triton is not installed"
    return None


def device_refused(*tensors: torch.Tensor) -> str | None:
    """Why Triton cannot run on these tensors' device, or None."""
    missing = triton_missing()
    if missing:
        return missing
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return "tensors on different devices"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    return f"{device.type} tensors need CUDA or TRITON_INTERPRET=1"


class Dispatcher:
    """`kernel` where `contract` allows it, else `reference`; see the module docstring.

    `contract(*args, **kwargs)` returns (key, None) when the kernel may run, or
    (key, reason) when it may not."""

    def __init__(self, name: str, kernel: Callable[..., Any], reference: Callable[..., Any],
                 contract: Callable[..., tuple[Hashable, str | None]]) -> None:
        self.name = name
        self.kernel, self.reference, self.contract = kernel, reference, contract
        self.launches = 0
        self.fallbacks: Counter[str] = Counter()
        self.failures: dict[Hashable, str] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, reason = self.contract(*args, **kwargs)
        if reason is None and key in self.failures:
            reason = f"launch failed before for this key: {self.failures[key]}"
        if reason is not None:
            return self._fallback(reason, args, kwargs)
        try:
            out = self.kernel(*args, **kwargs)
        except Exception as exc:
            with self._lock:
                self.failures[key] = f"{type(exc).__name__}: {exc}"
            log.warning("kernel %s failed for %s; using the reference from now on: %r", self.name, key, exc)
            return self._fallback("launch failed", args, kwargs)
        with self._lock:
            self.launches += 1
        return out

    def _fallback(self, reason: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._lock:
            self.fallbacks[reason] += 1
        return self.reference(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"launches": self.launches, "fallbacks": dict(self.fallbacks),
                    "failed_keys": [str(k) for k in self.failures]}

    def reset(self) -> None:
        with self._lock:
            self.launches = 0
            self.fallbacks.clear()
            self.failures.clear()
