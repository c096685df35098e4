"""Engine faults: the errors a lane raises for a step that went wrong, and what clients see.

A lane (server/lanes/scheduler.py, server/lanes/lm_lane.py) turns what went wrong in an engine step
into one of these errors, each naming the lane, so a session or servicer can pass the
message on without a traceback and without guessing which engine failed:

- `StepFailed`: the step raised (the engine's own error, or out of memory);
- `StepDeadlineExceeded`: the step ran past the lane's step deadline, and its items
  failed then rather than waiting for it;
- `LaneStalled`: a step of the lane is still running past its deadline; the engine takes
  no other step until it returns, so the item was refused at once (retry shortly).

An engine fault is never the client's mistake: `fault_status` maps it to INTERNAL
(`ENGINE_FAILED`), RESOURCE_EXHAUSTED (`OUT_OF_MEMORY`) or, for work the server could not
take now (a stalled lane, a recogniser worker being restarted), UNAVAILABLE
(`ENGINE_UNAVAILABLE`).
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc
from rtmedia.engines.base import EngineError, EngineUnavailable
from rtmedia.protocol.errors import abort

log = logging.getLogger(__name__)


class LaneFault(EngineError):
    """An engine step of lane `lane` went wrong; the message names the lane."""

    def __init__(self, lane: str, message: str) -> None:
        super().__init__(message)
        self.lane = lane


class StepFailed(LaneFault):
    """The lane's step raised; `__cause__` is what it raised."""


class StepDeadlineExceeded(LaneFault):
    """The lane's step ran past its deadline; its items failed at the deadline."""


class LaneStalled(LaneFault, EngineUnavailable):
    """The lane takes no work until a step running past its deadline returns."""


def describe(exc: BaseException) -> str:
    """`Type: message`, or what an out-of-memory error without a message means."""
    text = str(exc)
    if isinstance(exc, MemoryError) and not text:
        return "MemoryError (out of memory)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def step_failed(lane: str, exc: BaseException, what: str = "step") -> StepFailed:
    """The error an item of a failed step gets: names the lane and what the step raised."""
    fault = StepFailed(lane, f"the {lane} lane's {what} failed: {describe(exc)}")
    fault.__cause__ = exc
    return fault


def is_out_of_memory(exc: BaseException | None) -> bool:
    """MemoryError, torch's OutOfMemoryError, or a RuntimeError saying "out of memory", itself or
    as the cause of a lane's error."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True
        if isinstance(exc, RuntimeError) and not isinstance(exc, LaneFault) and "out of memory" in str(exc).lower():
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def fault_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and ErrorInfo reason a call ends with for an engine fault."""
    if is_out_of_memory(exc):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "OUT_OF_MEMORY"
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, "ENGINE_UNAVAILABLE"
    return grpc.StatusCode.INTERNAL, "ENGINE_FAILED"


async def abort_fault(context: grpc.aio.ServicerContext, exc: BaseException, what: str) -> NoReturn:
    """End the call for an engine fault: `what` (e.g. "transcription failed") and the fault's
    message, which names the lane; logged on the server without a traceback (the lane logged it)."""
    code, reason = fault_status(exc)
    log.warning("%s: %s", what, exc, extra={"reason": reason})
    await abort(context, code, reason, f"{what}: {exc}")
    raise AssertionError("unreachable: abort raises")
