"""turn_detection.idle_timeout_ms (docs/protocol.md#turns): a quiet user gets prompted.

In a `server_vad` session with `idle_timeout_ms` set, once the last response has ended and
its audio has finished playing at the client (`Response.playback_end`: the client's acks
when it sends them, else the audio sent, played from its first delta on) and no speech came
for `idle_timeout_ms`, the server sends input_audio_buffer.timeout_triggered, commits an empty
user turn and (with `create_response`) answers the conversation: the responder prompts the
user to go on. Speech resets the timer; so does each timeout, so a session that makes no
response to it is prompted again only after another quiet `idle_timeout_ms`. Nothing of this
runs before the session's first response, nor while a turn or a response is in progress.

This is not `idle_timeout_s`, which closes a session that gets no input at all.

`IdleTurns` is the part of a session that keeps when the quiet began and commits the empty
turn; `IdleTimer` owns its one timer: the session says when the quiet began
(`arm(since)`, None while it is not quiet) and what expiry means (`on_expiry`). An ack can
move the end of playback after the timer was set, so expiry checks again and re-arms when
the quiet turns out to have begun later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from rtmedia.engines.responders.contract import Message
from rtmedia.server.hearing.recognition import Turn
from rtmedia.server.lanes.clock import SYSTEM_CLOCK, Clock, Timer

if TYPE_CHECKING:
    from rtmedia.server.session.config import SessionSettings
    from rtmedia.server.session.reply import ReplyPipeline
    from rtmedia.server.session.tool_calls import ToolCalls


class IdleTimer:
    """One session's idle-turn timer. `quiet_since()` returns when the session became quiet
    (on the session's clock) or None; `on_expiry(since)` runs once it has been quiet for the timeout."""

    def __init__(self, quiet_since: Callable[[], float | None], timeout_ms: Callable[[], int | None],
                 on_expiry: Callable[[float], None], clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._quiet_since = quiet_since
        self._timeout_ms = timeout_ms
        self._on_expiry = on_expiry
        self._handle: Timer | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        """(Re)set the timer from the session's state now; it stops while the session is not quiet."""
        self.cancel()
        due = self._due()
        if due is not None:
            delay = max(0.0, due - self._clock.now())
            self._handle = self._clock.call_later(delay, self._expired)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _due(self) -> float | None:
        since, timeout = self._quiet_since(), self._timeout_ms()
        return None if since is None or timeout is None else since + timeout / 1000

    def _expired(self) -> None:
        self._handle = None
        due = self._due()
        if due is None:
            return
        if self._clock.now() < due - 0.001:  # playback ended later than it seemed (an ack came)
            self.arm()
            return
        since = self._quiet_since()
        assert since is not None
        self._on_expiry(since)


class IdleHost(Protocol):
    """What the idle turns see of their session: whether it is quiet, and how to answer."""

    settings: SessionSettings
    closing_reason: str | None
    turn: Turn | None
    history: list[Message]
    input_ms: float
    replies: ReplyPipeline
    tools: ToolCalls

    def new_id(self, prefix: str) -> str: ...
    def send(self, name: str, /, **fields: Any) -> None: ...


class IdleTurns:
    """A session's idle turns: when the quiet began (`quiet`), the timer, and the empty turn
    committed and answered when it expires."""

    def __init__(self, host: IdleHost, clock: Clock = SYSTEM_CLOCK) -> None:
        self.host = host
        self.clock = clock
        self.quiet_since = 0.0  # the session clock's time of the last speech stop or idle timeout
        self.quiet_input_ms = 0.0  # the input's length then, or when the last response ended
        self.timer = IdleTimer(self._since, lambda: host.settings.idle_timeout_ms, self._expired, clock)
        self.arm, self.cancel = self.timer.arm, self.timer.cancel

    def quiet(self) -> None:
        """The user stopped (a speech stop, a timeout, a change of turn detection): the quiet counts from now."""
        self.quiet_since, self.quiet_input_ms = self.clock.now(), self.host.input_ms

    def _since(self) -> float | None:
        """When the session became quiet for turn_detection.idle_timeout_ms: the end of the last
        response's playback or the last speech stop or timeout, whichever came last; None while
        not quiet (no response yet, a turn or response in progress, a function call out, closing)."""
        host = self.host
        response = host.replies.response
        if not host.settings.vad_turns or host.closing_reason is not None or response is None \
                or not response.done or host.turn is not None or host.replies.generating or host.tools.out:
            return None
        return max(response.playback_end(), self.quiet_since)

    def _expired(self, since: float) -> None:
        """input_audio_buffer.timeout_triggered: an empty turn is committed and answered."""
        host = self.host
        end_ms = round(host.input_ms)
        start_ms = max(round(self.quiet_input_ms), end_ms - round((self.clock.now() - since) * 1000))
        turn = Turn(host.new_id("item"), asyncio.get_running_loop().create_future())  # (no latency metric)
        host.send("input_audio_buffer.timeout_triggered", item_id=turn.item_id, audio_start_ms=max(0, start_ms),
                  audio_end_ms=end_ms)
        host.send("input_audio_buffer.committed", item_id=turn.item_id, audio_ms=0)
        turn.transcript.set_result("")
        host.history.append(Message("user", "", turn.item_id))
        self.quiet()
        if host.settings.create_response:
            host.replies.start(turn)
        else:
            self.arm()
