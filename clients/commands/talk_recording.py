"""`rtmedia talk --record FILE`: the client's side of a conversation as one stereo Ogg Opus file
(rtmedia.protocol.recording, the server's recordings' format): on the left what was sent, on the
right the replies as they were played, at the playback position (each from its first audio,
continuous while audio was there, cut where a barge-in cleared it), on the clock of the input
sent. The loop only hands audio over; one worker thread resamples, encodes and writes."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rtmedia.engines.audio.resample import make_resampler, pcm16_to_float
from rtmedia.protocol.recording import RATE, InputClock, OggOpusFile, Timeline, open_private

USER, AGENT = 0, 1


class TalkRecording:
    """One --record file. Opening it raises OSError (a bad path: the CLI's one-line error)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = open_private(path, replace=True)
        try:
            self._file = OggOpusFile(fd)
        except BaseException:
            os.close(fd)
            raise
        self._timeline = Timeline(make_resampler)
        self._clock = InputClock()
        self._sent_ms = 0.0
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="talk-record")
        self._last: Future[Any] | None = None
        self.error: BaseException | None = None

    def _submit(self, fn: Any, *args: Any) -> None:
        if self.error is None:
            self._last = self._worker.submit(self._run, fn, *args)

    def _run(self, fn: Any, *args: Any) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as exc:  # a full disk: the recording stops, the conversation goes on
            self.error = exc

    def sent(self, pcm16: bytes, rate: int, now: float | None = None) -> None:
        """A chunk of the user's audio went to the server."""
        start = self._sent_ms
        self._sent_ms += len(pcm16) / 2 * 1000 / rate
        self._clock.sent(self._sent_ms, time.perf_counter() if now is None else now)
        self._submit(self._user, pcm16, rate, round(start * RATE / 1000), round(self._sent_ms * RATE / 1000))

    def played(self, response_id: str, pcm16: bytes, rate: int, now: float | None = None) -> None:
        """A reply's audio came and plays from now, or after what of it is still playing."""
        at = round(self._clock.ms(time.perf_counter() if now is None else now) * RATE / 1000)
        self._submit(self._timeline.add, AGENT, response_id, pcm16_to_float(pcm16), rate, at)

    def cleared(self, response_id: str, now: float | None = None) -> None:
        """The reply stopped playing now (output_audio_buffer.cleared)."""
        at = round(self._clock.ms(time.perf_counter() if now is None else now) * RATE / 1000)
        self._submit(self._timeline.cut_from, response_id, at)

    def done(self, response_id: str) -> None:
        self._submit(self._timeline.finish, response_id, AGENT)

    def _user(self, pcm16: bytes, rate: int, at: int, end: int) -> None:
        self._timeline.add(USER, "user", pcm16_to_float(pcm16), rate, at)
        if upto := self._timeline.due(end):
            self._file.write(self._timeline.take(upto))

    def close(self) -> BaseException | None:
        """Write the rest and close the file (waits for the worker); the error that stopped the
        recording, if one did."""
        self._submit(self._finish)
        self._worker.shutdown(wait=True)
        if self.error is not None:
            with contextlib.suppress(Exception):  # the descriptor is closed either way
                self._file.close(finish=False)
        return self.error

    def _finish(self) -> None:
        timeline = self._timeline
        timeline.finish_all()
        self._file.write(timeline.take(timeline.end))
        self._file.close()
