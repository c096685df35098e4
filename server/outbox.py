"""A duplex session's outbound events, in the order the writer sends them.

Two lanes: control events (lifecycle, errors, barge-in, acks) overtake queued media
(transcription and reply deltas). Media carry the epoch of their response; cancelling a
response bumps the session's epoch, so media of an older epoch still queued, or produced
late by the cancelled response, are dropped rather than sent. The media lane is bounded:
a client that stops reading fills it, and the session ends instead of growing without limit.
"""

from __future__ import annotations

import asyncio
from collections import deque

from rtmedia.v1 import realtime_pb2


class Outbox:
    """Outbound events: control first, then media of the current epoch, in order."""

    def __init__(self, limit: int) -> None:
        self._control: deque[realtime_pb2.ConverseResponse] = deque()
        self._media: deque[tuple[int, realtime_pb2.ConverseResponse]] = deque()
        self._ready = asyncio.Event()
        self._limit = limit
        self.closed = False
        self._last: realtime_pb2.ConverseResponse | None = None

    def control(self, event: realtime_pb2.ConverseResponse) -> None:
        self._control.append(event)
        self._ready.set()

    def media(self, epoch: int, event: realtime_pb2.ConverseResponse) -> None:
        """Queue a media event of `epoch`; OverflowError when `limit` are waiting already."""
        if len(self._media) >= self._limit:
            raise OverflowError(f"the client is not reading: {len(self._media)} events are waiting")
        self._media.append((epoch, event))
        self._ready.set()

    def close(self, last: realtime_pb2.ConverseResponse | None = None) -> None:
        """No more events but `last`, which goes out after everything queued."""
        if not self.closed:
            self.closed, self._last = True, last
        self._ready.set()

    async def get(self, epoch: int) -> realtime_pb2.ConverseResponse | None:
        """The next event to write, or None once closed and empty."""
        while True:
            if self._control:
                return self._control.popleft()
            while self._media:
                event_epoch, event = self._media.popleft()
                if event_epoch == epoch:
                    return event
            if self.closed:
                last, self._last = self._last, None
                return last
            self._ready.clear()
            await self._ready.wait()
