"""Handing freed heap memory back to the system.

glibc keeps memory a process freed (in its arenas, or below the top of the heap) for
later allocations, so a burst (a thousand decoders' worth of speakers, a hostile client's
large messages) would leave the resident size at its peak for good. `trim_heap` asks it
to return what is free; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes


def trim_heap() -> None:
    """malloc_trim(0): return free heap pages to the system (a few ms; call it off the event loop)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
