"""Splitting reply text into speakable chunks (docs/protocol.md#streaming-tts).

Pure text, no model: the chunking rule shared by every caller that feeds text to
the TTS lane (the duplex sessions' replies, the SpeechService's Synthesize, Riva's
Synthesize and SynthesizeOnline, all through server/lanes/clauses.py). Audio starts early because the first chunk ends
at the first clause boundary or after at most FIRST_CHUNK_MAX_WORDS words; later
chunks end at clause boundaries, or after CHUNK_MAX_WORDS words so that one engine
step stays short. `TextChunker` cuts text that arrives in deltas (an LM's stream)
the same way `split_text` cuts a whole text.
"""

from __future__ import annotations

import re

FIRST_CHUNK_MAX_WORDS = 3
# Later chunks end at clause boundaries; a clause longer than this is cut so
# one engine step stays short.
CHUNK_MAX_WORDS = 40
_CLAUSE_END = re.compile(r"[,;:.?!][\"')\]]*$")
_SPEAKABLE = re.compile(r"\w")
# A streamed word that already ends its clause: a comma-like mark, or a period after a
# lowercase letter (not "3." of "3.14", nor "U." of "U.S.").
_ENDS_CLAUSE_NOW = re.compile(r"(?:[,;:?!]|(?<=[a-z])\.)[\"')\]]*$")


class TextChunker:
    """Splits streamed text into speakable chunks as it arrives (docs/protocol.md#streaming-tts): the
    first chunk ends at the first clause boundary or after three words, later ones
    at clause boundaries (or after CHUNK_MAX_WORDS words)."""

    def __init__(self) -> None:
        self._words: list[str] = []
        self._tail = ""  # a word that may continue in the next delta
        self._emitted = 0

    def feed(self, delta: str) -> list[str]:
        """Add text; return the chunks it completed."""
        text = self._tail + delta
        words = text.split()
        self._tail = words.pop() if words and not text[-1].isspace() else ""
        if _ENDS_CLAUSE_NOW.search(self._tail):  # "there," or "France.": complete without the next space
            words.append(self._tail)
            self._tail = ""
        chunks = []
        for word in words:
            self._words.append(word)
            limit = FIRST_CHUNK_MAX_WORDS if not self._emitted else CHUNK_MAX_WORDS
            if _CLAUSE_END.search(word) or len(self._words) >= limit:
                chunks.extend(self._take())
        return chunks

    def flush(self) -> list[str]:
        """The text is complete: return what is left as a last chunk."""
        if self._tail:
            self._words.append(self._tail)
            self._tail = ""
        return self._take()

    def _take(self) -> list[str]:
        chunk = " ".join(self._words)
        self._words = []
        if not _SPEAKABLE.search(chunk):
            return []
        self._emitted += 1
        return [chunk]


def split_text(text: str) -> list[str]:
    """Split a whole text into speakable chunks by the rule of docs/protocol.md#streaming-tts."""
    chunker = TextChunker()
    return chunker.feed(text) + chunker.flush()


def is_speakable(text: str) -> bool:
    """Whether the text has a letter or digit to speak."""
    return bool(_SPEAKABLE.search(text))
