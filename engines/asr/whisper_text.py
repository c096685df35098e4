"""Whisper's decode rules: where a hypothesis loops, what it writes over no speech, mended word edges,
and LocalAgreement-2 over partials (engines/asr/whisper.py's module docstring says why each is there).
"""

from __future__ import annotations

import re
import zlib

import numpy as np
from rtmedia.engines.asr.contract import SAMPLE_RATE, normal_words
from rtmedia.engines.asr.whisper_model import _HOP, Decoded

_NO_SPEECH = 0.6  # Whisper's no_speech_threshold ...
_LOW_LOGPROB = -1.0  # ... with its logprob_threshold
_SURE_NO_SPEECH = 0.75  # alone: speech on trimmed windows measured <= 0.05, noise >= 0.87
_MAX_COMPRESSION = 2.4
_STOCK = {"you", "thank you", "thank you very much", "thanks for watching", "thank you for watching"}

_SOUND = re.compile(r"^\s*(\[[^\]]*\]|\([^)]*\)|\*[^*]*\*|♪+)[\s.]*$")


def without_restart(words: list[str]) -> int:
    """How many of a hypothesis's words to keep: all, unless it loops. Whisper does that on
    windows shorter than its 30 s, where it takes the end of the window for more speech to come:
    it starts over (the rest is the hypothesis's own beginning again, once or more, the last
    time cut short by the token cap: after a sentence's end, or without one when at least three
    words come again), or it ends repeating a few words (one word four times or more, two to
    eight words three times or more), kept once. A speaker's own restart goes on past the
    words it repeats ("I want to, I want to go home"), so it is kept."""
    plain = [normal_words(w) for w in words]
    for end in range(len(words) - 1):
        rest = plain[end + 1 :]
        if not words[end].rstrip("\"')").endswith((".", "?", "!")) and len(rest) < 3:
            continue
        again = [plain[i % (end + 1)] for i in range(len(rest))]  # the beginning, once or more
        if rest and rest[:-1] == again[:-1] and _starts(again[-1], rest[-1]):  # (the cap may cut a word)
            return end + 1
    for unit in range(1, 9):
        times = 1
        while len(plain) >= (times + 1) * unit and \
                plain[len(plain) - (times + 1) * unit : len(plain) - times * unit] == plain[len(plain) - unit :]:
            times += 1
        if times >= (4 if unit == 1 else 3):
            return len(plain) - (times - 1) * unit
    return len(words)


def _starts(words: list[str], cut: list[str]) -> bool:
    """Whether `cut` (a word's normal words) is `words` or the beginning of them."""
    return len(cut) <= len(words) and cut[:-1] == words[: len(cut) - 1] and \
        (not cut or words[len(cut) - 1].startswith(cut[-1]))


def no_words(text: str, decoded: Decoded) -> bool:
    """Whether a decode's text is what Whisper writes over no speech (the module docstring)."""
    if decoded.no_speech_prob > _SURE_NO_SPEECH or (
            decoded.no_speech_prob > _NO_SPEECH and decoded.avg_logprob < _LOW_LOGPROB):
        return True
    if _SOUND.match(text) or not normal_words(text):
        return True
    if " ".join(normal_words(text)) in _STOCK and (decoded.no_speech_prob > 0.3 or decoded.avg_logprob < -0.7):
        return True
    raw = text.encode()
    return len(raw) > 24 and len(raw) / len(zlib.compress(raw)) > _MAX_COMPRESSION


def settled_edges(words: list[tuple[str, int, int, float]], audio: np.ndarray, offset_ms: int
                  ) -> list[tuple[str, int, int, float]]:
    """Word times with the utterance's edges mended: cross-attention gives the first word the
    silence before it (the VAD's prefix padding) and the last the silence after it. Each is held
    to twice the median word's length (at most 1.4 s), as faster-whisper does, and the first
    starts no sooner than the audio's first 10 ms frame louder than a tenth of its loud frames."""
    if not words:
        return words
    lengths = [e - s for _, s, e, _ in words if e > s]
    longest = 2 * min(700, int(np.median(lengths))) if lengths else 0
    text, start, end, prob = words[0]
    frames = audio[: audio.size // _HOP * _HOP].reshape(-1, _HOP)
    if frames.size:
        rms = np.sqrt(np.mean(np.square(frames), axis=1))
        loud = np.flatnonzero(rms >= 0.1 * np.percentile(rms, 95))
        if loud.size:
            start = max(start, min(end, offset_ms + int(loud[0]) * _HOP * 1000 // SAMPLE_RATE))
    if longest and end - start > longest:
        start = end - longest
    words = [(text, start, end, prob), *words[1:]]
    text, start, end, prob = words[-1]
    if longest and end - start > longest and len(words) > 1:
        words[-1] = (text, start, start + longest, prob)
    return words


class LocalAgreement:
    """LocalAgreement-2 over successive hypotheses of one utterance: a word is committed once
    two consecutive hypotheses agree on it and everything before it, and is never retracted;
    the newest word waits for the next hypothesis."""

    def __init__(self) -> None:
        self.committed: list[str] = []
        self._previous: list[str] = []

    def update(self, words: list[str]) -> list[str]:
        """Take a hypothesis (surface words); the words it newly commits."""
        new, old = [normal_words(w) for w in words], [normal_words(w) for w in self._previous]
        stable, limit = 0, min(len(words) - 1, len(old))
        while stable < limit and new[stable] == old[stable]:
            stable += 1
        self._previous = words
        if stable <= len(self.committed):
            return []
        if [normal_words(w) for w in words[: len(self.committed)]] != [normal_words(w) for w in self.committed]:
            return []  # the hypotheses moved under the committed words: wait until they agree again
        added = words[len(self.committed) : stable]
        self.committed.extend(added)
        return added
