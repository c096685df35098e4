"""A duplex session's outbound events, in the order the writer sends them.

Two lanes: control events (lifecycle, errors, barge-in, acks) overtake queued media
(transcription and reply deltas). Media carry the epoch of their response; cancelling a
response bumps the session's epoch, so media of an older epoch still queued, or produced
late by the cancelled response, are dropped rather than sent; all but a response's
response.done, which every response gets once (one that was all generated when a barge-in
came may still have it queued behind its audio).

Both lanes together are bounded in events and bytes: a client that stops reading fills
them. The first event that does not fit is dropped and an `error{client_too_slow}` (let in
past the bound) says so; if another does not fit before the client has read the queue down
to half, the outbox fails: it lets go of everything queued and tells `notify` (`OutboxFailed`), and the
session ends with RESOURCE_EXHAUSTED (CLIENT_TOO_SLOW).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rtmedia.protocol.events import event_type, server_event
from rtmedia.v1 import realtime_pb2


@dataclass(frozen=True, slots=True)
class OutboxFailed:
    """The client kept not reading: the outbox let go of what it held and takes no more."""


class Outbox:
    """Outbound events: control first, then media of the current epoch, in order, at most
    `max_events` events and `max_bytes` bytes (see the module docstring)."""

    def __init__(self, max_events: int, max_bytes: int = 8 * 1024 * 1024,
                 notify: Callable[[OutboxFailed], None] | None = None) -> None:
        # Entries keep their event's size, so the byte count is kept without measuring twice.
        self._control: deque[tuple[int, realtime_pb2.ConverseResponse]] = deque()
        self._media: deque[tuple[int, int, realtime_pb2.ConverseResponse]] = deque()
        self._ready = asyncio.Event()
        self.max_events, self.max_bytes = max_events, max_bytes
        self.notify = notify
        self._bytes = 0
        self.overflowing = False  # an event was dropped; the next one that does not fit fails the outbox
        self.failed = False
        self.closed = False
        self._last: realtime_pb2.ConverseResponse | None = None

    @property
    def queued(self) -> tuple[int, int]:
        """(events, bytes) waiting to be written."""
        return len(self._control) + len(self._media), self._bytes

    def _fits(self, event: realtime_pb2.ConverseResponse) -> int | None:
        """The event's size if it may be queued; None if it is dropped (the overflow rule)."""
        if self.failed:
            return None
        size = event.ByteSize()
        events, queued = self.queued
        if events < self.max_events and queued + size <= self.max_bytes:
            return size
        if not self.overflowing:
            self.overflowing = True
            notice = server_event("error", code="client_too_slow", message=(
                f"the client is not reading: {events} events ({queued} bytes) are waiting, over the outbox "
                f"limit of {self.max_events} events or {self.max_bytes} bytes; a {event_type(event)} "
                "event was dropped, and the session closes if the client does not catch up"))
            self._control.append((size := notice.ByteSize(), notice))
            self._bytes += size
            self._ready.set()
            return None
        self.failed = True
        self._control.clear()
        self._media.clear()
        self._bytes = 0
        if self.notify is not None:
            self.notify(OutboxFailed())
        return None

    def control(self, event: realtime_pb2.ConverseResponse) -> None:
        if (size := self._fits(event)) is not None:
            self._control.append((size, event))
            self._bytes += size
            self._ready.set()

    def media(self, epoch: int, event: realtime_pb2.ConverseResponse) -> None:
        """Queue a media event of `epoch`."""
        if (size := self._fits(event)) is not None:
            self._media.append((epoch, size, event))
            self._bytes += size
            self._ready.set()

    def _taken(self, size: int, event: realtime_pb2.ConverseResponse) -> realtime_pb2.ConverseResponse:
        self._bytes -= size
        if self.overflowing and self._bytes <= self.max_bytes // 2 and self.queued[0] <= self.max_events // 2:
            self.overflowing = False
        return event

    def close(self, last: realtime_pb2.ConverseResponse | None = None) -> None:
        """No more events but `last`, which goes out after everything queued."""
        if not self.closed:
            self.closed, self._last = True, last
        self._ready.set()

    async def get(self, epoch: int) -> realtime_pb2.ConverseResponse | None:
        """The next event to write, or None once closed and empty."""
        while True:
            if self._control:
                return self._taken(*self._control.popleft())
            while self._media:
                event_epoch, size, event = self._media.popleft()
                self._taken(size, event)
                if event_epoch == epoch or event.WhichOneof("event") == "response_done":
                    return event
            if self.closed:
                last, self._last = self._last, None
                return last
            self._ready.clear()
            await self._ready.wait()
