"""Interruptions that are meant (docs/protocol.md#interruptions): is voice during a reply a
barge-in, or a backchannel ("mhm", "yeah okay sure") the reply should talk over?

`immediate` (the default) is the VAD's word: any speech during a reply cancels it.
`confirmed` pauses the reply's audio when the voice starts and judges the voice as it is
recognised (`Voice.verdict`):
- it interrupts once it holds `min_words` words that are not all backchannels, or once it has
  lasted `min_speech_ms` without words that are all backchannels (nothing recognised yet, or
  real words). While it goes on, the words of a partial hypothesis count once the next
  hypothesis agrees on them (the first, a quarter second into a word, often mishears it:
  "Sure" as "Cheers", "Got it" as "that is"), or at once when they hold a word that interrupts
  on its own (`INTERRUPTING`: "stop", "wait", "no", ...); words that may be a backchannel's
  beginning ("i" of "i see") are not yet counted;
- at its first pause (the recogniser's early final) or its end, a voice whose words are all
  backchannels, or that holds no words (a cough, a door), is not an interruption: the reply
  resumes. Later words of the same turn may still make it one.

`is_backchannel` reads the words as the recogniser normalises them (lowercase, no
punctuation: Whisper's "Mm-hmm." is "mm hmm"), so a phrase of the list matches however it
was written, and a run of them ("yeah okay sure") is one backchannel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rtmedia.engines.asr.contract import normal_words

MODES = ("immediate", "confirmed")
BACKCHANNELS = (
    "mhm", "mm", "mmm", "mm hmm", "m hmm", "hmm", "uh huh", "aha", "ah ha", "uh", "um", "ah", "oh", "ooh", "yeah", "yes", "yep",
    "yup", "okay", "ok", "right", "sure", "i see", "got it", "alright", "all right", "cool", "nice", "great",
    "exactly", "true", "wow", "really", "indeed", "of course", "sounds good", "makes sense", "make sense",
)
# Words that are an interruption whatever follows: a hypothesis holding one counts at once.
INTERRUPTING = frozenset({"stop", "wait", "hold", "hang", "pause", "cancel", "no", "sorry", "excuse", "actually",
                          "but"})
MAX_BACKCHANNELS = 100  # phrases a session may list
MAX_BACKCHANNEL_CHARS = 64
BOUNDS = {"min_words": (1, 20), "min_speech_ms": (200, 10000), "false_interruption_timeout_ms": (100, 10000)}

Verdict = Literal["interrupt", "backchannel"] | None


@dataclass(frozen=True)
class Interruption:
    """A session's `turn_detection.interruption` settings."""

    mode: str = "immediate"
    min_words: int = 1
    min_speech_ms: int = 1500
    false_interruption_timeout_ms: int = 1000  # after the voice stops unconfirmed, the reply resumes by then
    backchannels: tuple[str, ...] = BACKCHANNELS

    @property
    def phrases(self) -> frozenset[tuple[str, ...]]:
        return frozenset(tuple(normal_words(p)) for p in self.backchannels if normal_words(p))


def is_backchannel(words: list[str], phrases: frozenset[tuple[str, ...]], open_end: bool = False) -> bool:
    """Whether `words` (normal words, at least one) are one or more phrases of `phrases` in a row;
    `open_end`: or such a run followed by the beginning of a phrase (words still being said:
    "i" may become "i see", "sur" "sure")."""
    if not words:
        return False
    longest = max((len(p) for p in phrases), default=0)
    reach = [True] + [False] * len(words)  # reach[i]: the first i words are whole phrases
    for i in range(len(words)):
        if reach[i]:
            for n in range(1, min(longest, len(words) - i) + 1):
                if tuple(words[i : i + n]) in phrases:
                    reach[i + n] = True
            rest = words[i:]
            if open_end and any(len(p) >= len(rest) and p[: len(rest) - 1] == tuple(rest[:-1])
                                and p[len(rest) - 1].startswith(rest[-1]) for p in phrases):
                return True
    return reach[-1]


@dataclass
class Voice:
    """Voice heard during a reply in `confirmed` mode, until it is judged: its turn's item, where
    it started in the input, the response it paused, and what was held back meanwhile (the
    turn's transcription deltas: its speech_started waits for the confirmation too)."""

    item_id: str
    start_ms: int
    response: Any  # server/session/reply.py's Response, paused
    started_at: float  # perf_counter when the voice was heard
    settings: Interruption
    speech_ms: int = 0  # how long it has lasted so far
    heard: str = ""  # its words so far, agreed or not: the latest hypothesis
    previous: str = ""  # the hypothesis before it
    deltas: list[str] = field(default_factory=list)
    dismissed: bool = False  # judged not an interruption (the reply resumed); later words may still be one
    stop: Any = None  # the turn's end (server/hearing/audio_input.py's Stop), once the VAD found it
    timer: Any = None  # the task that resumes the reply if no verdict comes in time

    def hear(self, text: str) -> None:
        """A new partial hypothesis of the voice so far."""
        self.previous, self.heard = self.heard, text

    def verdict(self, text: str, speech_ms: int, final: bool) -> Verdict:
        """`text` recognised so far of `speech_ms` of voice (while it goes on, the latest
        hypothesis); `final`: at a pause or the end."""
        words = normal_words(text)
        counted = words
        if not final and not INTERRUPTING.intersection(words):
            before = normal_words(self.previous)
            agreed = 0
            while agreed < min(len(words), len(before)) and words[agreed] == before[agreed]:
                agreed += 1
            counted = words[:agreed]
        phrases = self.settings.phrases
        if counted and len(counted) >= self.settings.min_words \
                and not is_backchannel(counted, phrases, open_end=not final):
            return "interrupt"
        if speech_ms >= self.settings.min_speech_ms and not is_backchannel(words, phrases, open_end=not final):
            return "interrupt"
        return "backchannel" if final else None
