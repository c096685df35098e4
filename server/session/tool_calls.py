"""A session's function calls and the wait for their outputs (docs/protocol.md#tools).

A response that calls functions ends (response.done, completed, with its function_call items)
and the session is then waiting for the tool: the calls are out until the client sends each
one's function_call_output (conversation.item.create) and asks for the answer
(response.create). Two timers run while a call is out:
- `tool_filler_ms`: still out that long and nothing playing, the server speaks a filler
  ("One moment.", from `Limits.tool_fillers`), a response of its own marked `filler`, cut when
  the answer's response starts;
- `tool_timeout_ms`: still out that long, the server ends the wait with a short spoken apology
  (`Limits.tool_apology`), a response of its own whose response.done says `tool_timeout`.

A user turn during the wait is answered as usual and ends the wait (the timers stop); the call
stays in the history unanswered, and its late output is still accepted. `ToolCalls` keeps the
calls and the timers, and starts the filler and the apology on the session's reply pipeline.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rtmedia.engines.responders.contract import FunctionCall
from rtmedia.server.lanes.clock import SYSTEM_CLOCK, Clock, Timer

if TYPE_CHECKING:
    from rtmedia.server.session.config import SessionSettings
    from rtmedia.server.session.limits import Limits
    from rtmedia.server.session.reply import ReplyPipeline


@dataclass
class Call:
    """A function call a response made, and whether its output came."""

    call: FunctionCall
    item_id: str
    output_index: int = 1  # its place in the response's output (0: the reply's message)
    answered: bool = False
    begun_at: float = field(default_factory=time.perf_counter)  # its first delta (its trace span's start)


class ToolCalls:
    """Every call of the session by call id, and the wait on the latest response's calls, with
    its two timers: the filler and the apology are responses the reply pipeline starts, unless
    the session is closing."""

    def __init__(self, settings: Callable[[], SessionSettings], limits: Limits, replies: ReplyPipeline,
                 closing: Callable[[], bool], clock: Clock = SYSTEM_CLOCK) -> None:
        self.calls: dict[str, Call] = {}
        self.waiting: list[Call] = []  # the calls of the wait; empty: not waiting
        self._settings, self._limits, self._replies, self._closing = settings, limits, replies, closing
        self._fillers = itertools.cycle(limits.tool_fillers)
        self._clock = clock
        self._timers: list[Timer] = []

    @property
    def out(self) -> list[Call]:
        """The calls of the wait that have no output yet."""
        return [c for c in self.waiting if not c.answered]

    def made(self, calls: list[Call]) -> None:
        """A response ended with `calls`: the session waits for them."""
        self.stop()
        for call in calls:
            self.calls[call.call.call_id] = call
        self.waiting = list(calls)
        settings = self._settings()
        if settings.tool_filler_ms:
            self._timers.append(self._clock.call_later(settings.tool_filler_ms / 1000, self._filler))
        self._timers.append(self._clock.call_later(settings.tool_timeout_ms / 1000, self._timed_out))

    def answer(self, call_id: str) -> Call | None:
        """The client's output for `call_id` came: the call, or None for an id no response made.
        With every call of the wait answered, the timers stop (nothing is out any more)."""
        call = self.calls.get(call_id)
        if call is None:
            return None
        call.answered = True
        if self.waiting and not self.out:
            self._cancel_timers()
        return call

    def stop(self) -> None:
        """The wait ends (its answer started, a user turn came, the session closes)."""
        self.waiting = []
        self._cancel_timers()

    def _cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def _filler(self) -> None:
        """A call is still out after tool_filler_ms: a filler, unless something plays already."""
        replies = self._replies
        if self.out and not replies.generating and not self._closing():
            replies.start(None, joins_history=False, say=next(self._fillers), filler=True)

    def _timed_out(self) -> None:
        """A call went unanswered for tool_timeout_ms: the server's apology ends the wait (a
        filler still playing gives way to it)."""
        if not self.out:
            return
        self.stop()
        if self._closing():
            return
        replies = self._replies
        if replies.generating and replies.response is not None and replies.response.filler:
            replies.cancel("tool_timeout")
        if not replies.generating:
            replies.start(None, say=self._limits.tool_apology, reason="tool_timeout")
