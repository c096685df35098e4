"""semantic_vad (docs/protocol.md#semantic-vad): at each pause, has the user finished?

The VAD still finds speech. At each pause the recogniser finishes the words so far
(the early final, 160 ms into the silence); as the silence reaches each candidate
point (server/hearing/turns.py `candidate_points`: 200 ms by default, then 600 ms and 1.5 s)
the text scorer (engines/turn/scorers.py, on the LM lane) gives log10 P(finished) for those
words, and the turn ends there when it reaches the eagerness's threshold for that
much silence; else the session keeps listening. The thresholds fall as the silence
grows, so a doubtful ending is accepted after a longer pause; at the eagerness's
longest wait (8 / 4 / 2 s for low / medium / high) the turn ends whatever the score
(server/hearing/audio_input.py). Speech that resumes continues the same turn.

- A last word the recogniser doubts (confidence under DOUBTFUL): on a sentence cut short
  Whisper often ends it with a word of its own ("how tall is the" heard as "How tall is
  that?"), which would make it look finished. Until DOUBT_MS of silence such a pause ends
  the turn only when the words look finished both with and without that word (the lower
  of the two scores); from then on the words as heard decide, so a finished sentence whose
  last word the recogniser doubted ends then rather than at the longest wait.
- Words are scored once per text (a rescore of the same words compares the same score
  with a lower threshold).
- A pause with no words (noise) never ends a turn early.
- Without words to score (transcription off), or when the LM had no slot for the score,
  the pause ends at server_vad's silence_duration_ms, reason "silence".
- With the acoustic scorer loaded (`--turn-audio-model`), a turn ends early only when it
  also hears the end: P(complete) of the turn's last 8 s at least AUDIO_THRESHOLD.

THRESHOLDS come from the measured scores (BENCHMARKS.md, semantic_vad): on the recogniser's
transcripts finished requests scored -2.0..-0.1, first parts of paused ones -5.8..-0.3, most
below -3; tests/unit/test_turn_scorer.py holds medium's first threshold between the finished
and unfinished transcripts of tests/support/turn_texts.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
from rtmedia.engines.base import EngineError
from rtmedia.server.hearing.audio_input import Stop
from rtmedia.server.hearing.recognition import Turn
from rtmedia.server.lanes.access import Turns
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.session.config import SessionSettings

log = logging.getLogger(__name__)

# log10 P(finished) a pause's words need, by eagerness: before 600 ms of silence, from 600 ms,
# from 1.5 s.
THRESHOLDS = {"high": (-2.6, -3.2, -4.0), "medium": (-2.2, -2.6, -3.2), "low": (-1.5, -2.0, -2.6)}
AUDIO_THRESHOLD = 0.5
DOUBTFUL = 0.8  # a last word below this confidence is doubted (the module docstring) ...
DOUBT_MS = 1500  # ... until this much silence
TURN_AUDIO_SAMPLES = 8 * 16000  # the acoustic scorer hears the turn's last 8 s


def threshold(eagerness: str, silence_ms: int, thresholds: dict[str, tuple[float, float, float]] | None = None
              ) -> float:
    """The score a pause's words need after `silence_ms` (`thresholds`: the server's own, by eagerness)."""
    low, mid, late = {**THRESHOLDS, **(thresholds or {})}["medium" if eagerness == "auto" else eagerness]
    return late if silence_ms >= 1500 else mid if silence_ms >= 600 else low


@dataclass(frozen=True, slots=True)
class TurnEnds:
    """semantic_vad decided: the turn ends at `stop`."""

    stop: Stop


class SemanticTurns:
    """One session's semantic_vad decisions. The session calls `started(assistant)` when speech
    starts, `audio(pcm)` with the turn's 16 kHz audio, `paused(turn)` when a pause's words are
    being recognised (they are scored as soon as they are in), `candidate(...)` at each candidate
    point and `ended()` when the turn ends; a decision to end is told to `notify` (`TurnEnds`)."""

    def __init__(self, session_id: str, turns: Turns, metrics: Metrics, settings: Callable[[], SessionSettings],
                 notify: Callable[[TurnEnds], None], spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
                 thresholds: dict[str, tuple[float, float, float]] | None = None) -> None:
        self.key = ("turn", session_id)  # the scorer's kept slot on the LM lane
        self._turns = turns
        self._metrics = metrics
        self._settings = settings
        self._notify = notify
        self._spawn = spawn
        self._thresholds = thresholds
        self._assistant = ""
        self._scores: dict[str, Any] = {}  # words -> the task scoring them (this turn's)
        self._holds_slot = False  # a score was asked for since the scorer's slot was given back
        self._one_at_a_time = asyncio.Lock()  # the session's scores share its one kept slot
        self._audio: list[bytes] = []  # the turn's 16 kHz PCM16, for the acoustic scorer
        self._audio_bytes = 0

    def started(self, assistant: str) -> None:
        """A turn starts; `assistant` is the conversation's last assistant message. (Its prompt is
        not prefilled ahead: on the CPU a forward costs about the same for 1 token as for 30, so
        that would double the scorer's cost for nothing; BENCHMARKS.md, semantic_vad.)"""
        self._assistant, self._scores = assistant, {}
        self._audio, self._audio_bytes = [], 0

    def audio(self, pcm: bytes) -> None:
        if not self._turns.hears:
            return
        self._audio.append(pcm)
        self._audio_bytes += len(pcm)
        while self._audio_bytes - len(self._audio[0]) >= 2 * TURN_AUDIO_SAMPLES:
            self._audio_bytes -= len(self._audio.pop(0))

    def ended(self) -> None:
        """The turn ended: the scorer's slot, if it took one, is given back for the reply."""
        self._scores = {}
        if self._holds_slot:
            self._holds_slot = False
            self._turns.forget(self.key)

    def paused(self, turn: Turn) -> None:
        if self._turns.available and self._settings().transcription:
            self._spawn(self._scored(turn, doubting=True), "turn-score")

    def candidate(self, turn: Turn, silence_ms: int, end_ms: int) -> None:
        """The pause that began at `end_ms` has lasted `silence_ms`: decide (in a task)."""
        self._spawn(self._decide(turn, silence_ms, end_ms), "turn-decide")

    async def _decide(self, turn: Turn, silence_ms: int, end_ms: int) -> None:
        settings = self._settings()
        if settings.transcription and self._turns.available:
            words, score = await self._scored(turn, doubting=silence_ms < DOUBT_MS)
            if not words:
                return  # noise: never an early end
            if score is not None:
                if score >= threshold(settings.eagerness, silence_ms, self._thresholds) and await self._hears_end():
                    self._notify(TurnEnds(Stop(end_ms, "semantic", score)))
                return
        if silence_ms >= settings.silence_duration_ms:  # nothing to score: server_vad's rule
            self._notify(TurnEnds(Stop(end_ms, "silence")))

    async def _scored(self, turn: Turn, doubting: bool) -> tuple[str, float | None]:
        """The words of the turn up to its latest pause, and their score (each text scored once;
        `doubting`: the lower score of the words with and without a doubtful last word)."""
        if turn.cut_done is not None:
            await turn.cut_done  # the early final of this pause
        words = turn.sentence
        if not words:
            return words, None
        texts = [words]
        heard = turn.words
        if doubting and len(heard) > 1 and heard[-1][3] < DOUBTFUL:
            texts.append(words.rsplit(" ", 1)[0])
        for text in texts:
            if text not in self._scores:
                self._scores[text] = self._spawn(self._score(self._settings().responder, text), "turn-score")
        scores = [await asyncio.shield(self._scores[text]) for text in texts]
        known = [score for score in scores if score is not None]
        return words, min(known) if len(known) == len(scores) else None

    async def _score(self, responder: str, words: str) -> float | None:
        """The words' score; None when there is none to be had (no slot, or the LM lane's step
        failed: the pause then ends as server_vad's would)."""
        async with self._one_at_a_time:
            return await self._score_alone(responder, words)

    async def _score_alone(self, responder: str, words: str) -> float | None:
        started = time.perf_counter()
        self._holds_slot = True
        try:
            score = await self._turns.score(responder, self.key, self._assistant, words)
        except EngineError as exc:
            log.warning("end-of-turn score failed: %s", exc)
            return None
        self._metrics.turn_score_seconds.observe(time.perf_counter() - started)
        return score

    async def _hears_end(self) -> bool:
        if not self._turns.hears or not self._audio:
            return True
        audio = np.frombuffer(b"".join(self._audio), np.int16).astype(np.float32) / 32768
        try:
            return await self._turns.hear(audio) >= AUDIO_THRESHOLD
        except EngineError as exc:  # the text score decides alone
            log.warning("acoustic end-of-turn score failed: %s", exc)
            return True
