"""When a client acknowledges a reply's playback (`playback.ack`, docs/protocol.md#events), named once.

A client that plays a reply tells the server how far it got: every `ACK_EVERY_MS` of played
audio, and a last time once the reply is over (played out, or cut) if anything was played
since the last ack. Every door that plays replies (the WebRTC bridge's and a SIP call's
playout, `rtmedia talk`, `talk --mic`, the load test) keeps one `PlaybackAck` per reply.
"""

from __future__ import annotations

from dataclasses import dataclass

ACK_EVERY_MS = 200


@dataclass
class PlaybackAck:
    """One reply's acknowledgements: `acked_ms`, the last `played_ms` acknowledged (0: none yet)."""

    acked_ms: int = 0

    def due(self, played_ms: int, over: bool) -> int | None:
        """The `played_ms` to send in a `playback.ack` now, or None: due once `ACK_EVERY_MS` more has
        played since the last ack, or when the reply is `over` and anything played since. A due ack
        counts as sent (`acked_ms` becomes `played_ms`)."""
        if played_ms - self.acked_ms >= ACK_EVERY_MS or (over and played_ms > self.acked_ms):
            self.acked_ms = played_ms
            return played_ms
        return None
