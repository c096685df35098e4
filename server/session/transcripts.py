"""A session's transcription events (docs/protocol.md#events): the recogniser's deltas,
its completed transcripts with word timings, and its faults, as the client hears of them.

The user's turns and the audio items (server/session/items.py) both report here. A delta of
a voice being judged as a possible interruption is held by the interruption machine
(server/session/interruptions.py) until its verdict; every other goes out at once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from rtmedia.server.hearing.recognition import Delta, Fault, Turn, token_infos
from rtmedia.server.lanes.faults import fault_status
from rtmedia.server.session.interruptions import Interruptions

log = logging.getLogger(__name__)


class Transcripts:
    """The transcription events of one session. `pending` holds its committed turns whose
    transcript is not in yet, oldest first."""

    def __init__(self, session_id: str, send: Callable[..., None], interruptions: Interruptions) -> None:
        self.session_id = session_id
        self._send = send
        self._interruptions = interruptions
        self.pending: deque[Turn] = deque()

    def delta(self, delta: Delta) -> None:
        turn = delta.turn
        if not self._interruptions.hold(turn, delta.text):
            self._send("conversation.item.input_audio_transcription.delta", item_id=turn.item_id, delta=delta.text)

    def failed(self, fault: Fault) -> None:
        """An engine fault while transcribing (server/hearing/recognition.py): the client is told with
        conversation.item.input_audio_transcription.failed (the code is the fault's status reason,
        lowercase), and the session goes on."""
        turn, exc = fault.turn, fault.error
        log.warning("transcription failed: %s", exc, extra={"session_id": self.session_id})
        self._send("conversation.item.input_audio_transcription.failed", item_id=turn.item_id,
                   code=fault_status(exc)[1].lower(),
                   message=f"transcribing {turn.item_id or 'the turn'} failed: {exc}; the turn keeps what was "
                           "recognised before, and the session goes on")

    def completed(self, turn: Turn) -> None:
        """conversation.item.input_audio_transcription.completed: the turn's transcript, its
        segments' finals joined, with word timings in the input; the turn is no longer pending."""
        words: list[dict[str, Any]] = [{"word": w, "start_ms": s, "end_ms": e, "confidence": c}
                                       for w, s, e, c in turn.words]
        self._send("conversation.item.input_audio_transcription.completed", item_id=turn.item_id,
                   transcript=turn.said, words=words, tokens=token_infos(turn.tokens))
        self.forget(turn)

    def forget(self, turn: Turn) -> None:
        if turn in self.pending:
            self.pending.remove(turn)
