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

`IdleTimer` owns the one timer of a session; the session says when the quiet began
(`arm(since)`, None while it is not quiet) and what expiry means (`on_expiry`). An ack can
move the end of playback after the timer was set, so expiry checks again and re-arms when
the quiet turns out to have begun later.
"""

from __future__ import annotations

from collections.abc import Callable

from rtmedia.server.session.clock import SYSTEM_CLOCK, Clock, Timer


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
