"""A recognition whose utterances the VAD finds: the duplex sessions' input path for a stream of
audio that is not a session (Riva's recognisers, `Transcribe` with `vad_segmentation`).

Its audio goes through an `AudioInput` on the shared VAD tick lane (decode, resample to 16 kHz,
batched Silero VAD), whose turn detector is a `HistoryEndpointer` (server/hearing/endpointing.py). Each
utterance it finds is decoded on the ASR lane (PocketSphinx worker processes, one utterance per
turn) by the `Recognizer` the sessions use too (server/hearing/recognition.py). Each partial and final
goes through the caller's `convert` into `results`, then None at the end, or a `Rejected` when
the recogniser failed.

With `parallel` > 1 (a recording sent faster than real time) the utterances go to that many
recognisers in turn, each on a stream of its own and so, where the engine has as many worker
processes, decoded at the same time; the results still come out in the utterances' order (a
later utterance's wait until the one before has its final), each `utterance_index` its place in
that order.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
from rtmedia.engines.asr.contract import AsrEvent
from rtmedia.protocol.turn_kinds import SERVER_VAD
from rtmedia.server.hearing.audio_input import BYTES_PER_SAMPLE, WINDOW_MS, Action, AudioInput
from rtmedia.server.hearing.endpointing import DEFAULTS, HistoryEndpointer
from rtmedia.server.hearing.recognition import Heard, Recognition, Recognizer, Turn
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.services.riva_common import INVALID, Rejected
from rtmedia.server.session.config import SessionSettings

log = logging.getLogger(__name__)
# Audio is taken in pieces of at most this much; a piece waits while the previous one is still
# queued for the VAD tick, so a client sending faster than real time is slowed by flow control
# (never dropped) and one tick decodes at most ~2 pieces of one stream.
PIECE_MS = 500


class VadRecognition:
    """One recognition: audio in (`feed`, `finish`), converted results out (`results`, None at
    the end). `convert(event, turn)` makes a result of a partial or final, or None to skip it;
    `turn.shift_ms` maps the event's offsets to the stream's time. `language`: what the audio is
    said in, a code the recogniser serves (`Asr.language`), "" to detect it."""

    def __init__(self, access: EngineAccess, encoding: int, sample_rate: int,
                 convert: Callable[[AsrEvent, Turn], Any], endpointing: dict[str, float] | None = None,
                 priority: Priority = Priority.REALTIME, name: str = "vad-recognition", parallel: int = 1,
                 partials: bool = True, prompt: str = "", language: str = "") -> None:
        self.access = access
        self.convert = convert
        self.width = BYTES_PER_SAMPLE[encoding]
        self.results: asyncio.Queue[Any] = asyncio.Queue()
        endpointer = HistoryEndpointer(**(endpointing or DEFAULTS))  # type: ignore[arg-type]
        settings = SessionSettings(
            input_encoding=encoding, input_rate=sample_rate, turn_type=SERVER_VAD,
            threshold=endpointer.threshold, prefix_padding_ms=endpointer.prefix_padding_ms,
            silence_duration_ms=endpointer.silence_duration_ms,
        )
        # Whole samples: at a rate such as 11025 Hz half a second is not (the VAD tick decodes the
        # inbox as samples).
        self.piece = sample_rate * PIECE_MS // 1000 * self.width
        self.input = AudioInput(settings, 4 * PIECE_MS, self._on_actions, access.vad.open(),
                                make_detector=lambda _settings: endpointer)
        self._turn: Turn | None = None  # the utterance being spoken
        self._turns = 0  # utterances begun
        self._on = 0  # the recogniser of the utterance being spoken
        self.recognizers = [Recognizer(access.asr, priority=priority, partials=partials, prompt=prompt,
                                       language=language, notify=self._on_result)
                            for _ in range(max(1, parallel))]
        self._asr_ms = [0] * len(self.recognizers)  # audio sent to each recogniser
        # Utterances in order, each with its results not yet put out and whether its final came.
        self._order: deque[tuple[Turn, list[AsrEvent], list[bool]]] = deque()
        self._entries: dict[int, tuple[Turn, list[AsrEvent], list[bool]]] = {}
        self._running = len(self.recognizers)
        access.vad.attach(self.input)
        for n, recognizer in enumerate(self.recognizers):
            recognizer.start(f"{name}-{n}").add_done_callback(self._recognised)

    async def feed(self, audio: bytes) -> None:
        """Queue audio for the VAD tick, piece by piece, waiting while a piece is still queued."""
        if len(audio) % self.width:
            raise Rejected(INVALID, "BAD_AUDIO", f"audio has {len(audio)} bytes: not whole {8 * self.width}-bit "
                           "samples")
        for start in range(0, len(audio), self.piece):
            # the tick takes the inbox on its own 32 ms clock, with no event to wait on
            while len(self.input.inbox) >= self.piece:  # noqa: ASYNC110
                await asyncio.sleep(WINDOW_MS / 1000)
            self.input.append(audio[start:start + self.piece])

    async def finish(self) -> None:
        """The audio is complete: once the tick has taken all of it, end an open utterance."""
        taken = asyncio.get_running_loop().create_future()
        self.input.after_input(lambda: taken.set_result(None))
        await taken
        self._end()
        for recognizer in self.recognizers:
            recognizer.stop()

    def fail(self, exc: Rejected) -> None:
        self.results.put_nowait(exc)

    async def close(self) -> None:
        self.access.vad.detach(self.input)
        for recognizer in self.recognizers:
            await recognizer.close()

    # ---- VAD tick results (on the loop) ----------------------------------------
    def _on_actions(self, actions: list[Action]) -> None:
        for kind, value in actions:
            if kind == "audio":
                offset_ms, pcm = value
                if self._turn is None:  # the first audio of a turn: its start, prefix included
                    self._begin(offset_ms)
                assert self._turn is not None
                self._asr_ms[self._on] += len(pcm) // 32
                self.recognizers[self._on].send("audio", self._turn, pcm)
            elif kind == "stopped":
                self._end()
            elif kind == "marker":
                value()

    def _begin(self, offset_ms: int) -> None:
        """An utterance starts: on the next recogniser, in line for its results."""
        self._on = self._turns % len(self.recognizers)
        self._turns += 1
        self._turn = Turn(input_offset_ms=offset_ms, asr_offset_ms=self._asr_ms[self._on])
        entry: tuple[Turn, list[AsrEvent], list[bool]] = (self._turn, [], [False])
        self._order.append(entry)
        self._entries[id(self._turn)] = entry

    def _end(self) -> None:
        """The utterance ended: the recogniser finishes it (nothing to do if it had no audio)."""
        turn, self._turn = self._turn, None
        if turn is not None:
            self.recognizers[self._on].send("end", turn)

    # ---- recognition ----------------------------------------------------------
    def _recognised(self, task: asyncio.Task[None]) -> None:
        """A recogniser's task ended: after the last results (None once all have), or failed."""
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:  # an engine failure ends the call with a status
            log.error("recognition failed", exc_info=exc)
            self.fail(Rejected(grpc.StatusCode.INTERNAL, "ENGINE_FAILED", f"recognition failed: {exc}"))
            return
        self._running -= 1
        if not self._running:
            self.results.put_nowait(None)

    def _on_result(self, result: Recognition) -> None:
        """Put out, in the utterances' order, what has come for the first utterances in line."""
        if not isinstance(result, Heard):
            return
        turn, event = result.turn, result.event
        entry = self._entries.get(id(turn))
        if entry is None:
            return
        entry[1].append(event)
        entry[2][0] = entry[2][0] or event.is_final
        while self._order:
            head, events, final = self._order[0]
            for waiting in events:
                waiting.utterance_index = self._turns - len(self._order)
                if (result := self.convert(waiting, head)) is not None:
                    self.results.put_nowait(result)
            events.clear()
            if not final[0]:
                break
            self._order.popleft()
            del self._entries[id(head)]
