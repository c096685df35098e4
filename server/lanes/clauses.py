"""Text to spoken clauses: cut as soon as complete, synthesised in order, one clause ahead.

Every caller that speaks text on a TTS stream (the SpeechService's Synthesize, Riva's Synthesize
and SynthesizeOnline, a duplex session's replies) goes through `Clauses`, so the rule lives here
once: text comes whole (`whole`) or in deltas (`feed`, then `end`), `engines/tts/text_chunks.py`
cuts it into clauses by the streaming rule (docs/protocol.md#streaming-tts) as soon as each is
complete, and each clause is one TTS item, submitted in order and one at a time (a stream is
stateful: its resampler, and a windowed stream's undecoded frames, run from item to item), the
next as soon as the one before is synthesised: while the consumer sends a clause's audio the next
clause is synthesising. `ahead` bounds how far synthesis may run beyond what the consumer has
taken (Synthesize: one clause, so its client's reading paces it); a reply paces itself by its due
times, and a responder feeding text by waiting for the item submitted last (`last`). A windowed
stream's long sentence goes on as items of no text while the
stream has frames pending. How an item is submitted (its priority, when it is due) is the
caller's `synthesize`.

A whole text's last clause is its final item (it also flushes the resampler's tail); a streamed
text ends with an item of no text that does. The consumer iterates the clauses' audio in order;
a failed synthesis is raised at its clause and nothing after it is submitted, and an error the
producer ends with (`end(error)`) is raised after the clauses queued before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rtmedia.engines.tts.piper import TtsItem, TtsStream
from rtmedia.engines.tts.text_chunks import TextChunker


@dataclass(frozen=True)
class Clause:
    """One item's audio: `text` is the clause ("" for a window of the sentence before it, or the
    streamed text's closing item), `final` whether it was the stream's last item."""

    text: str
    final: bool
    audio: bytes


class Clauses:
    """One stream's clauses (see the module). `synthesize(item)` submits one TTS item and returns
    its PCM16 audio (a coroutine, or a future already submitted). `ahead`: at most this many items
    synthesised beyond the one the consumer is waiting for (None: no bound, each item is submitted
    once the one before is synthesised). Needs a running loop; `cancel` when done with it."""

    def __init__(self, stream: TtsStream, synthesize: Callable[[TtsItem], Awaitable[bytes]], *,
                 ahead: int | None = None) -> None:
        self.stream = stream
        self._synthesize = synthesize
        self._ahead = ahead
        self._chunker = TextChunker()
        self._texts: asyncio.Queue[tuple[str, bool] | BaseException | None] = asyncio.Queue()
        self._out: asyncio.Queue[tuple[str, bool, asyncio.Future[bytes]] | BaseException | None] = asyncio.Queue()
        self._asked = 0  # items the consumer has asked for
        self._wake = asyncio.Event()  # the consumer asked for one more
        self.last: asyncio.Future[bytes] | None = None  # the item submitted last
        self._task = asyncio.ensure_future(self._run())

    # ---- text in ---------------------------------------------------------------
    def cut(self, delta: str) -> list[str]:
        """The clauses `delta` completes (not yet queued: `put` them)."""
        return self._chunker.feed(delta)

    def cut_rest(self) -> list[str]:
        """The text is complete: what is left of it as a last clause (not yet queued)."""
        return self._chunker.flush()

    def put(self, clause: str, final: bool = False) -> None:
        """Queue one clause for synthesis, after those queued before it."""
        self._texts.put_nowait((clause, final))

    def feed(self, delta: str) -> list[str]:
        """Add streamed text; the clauses it completes are queued and returned."""
        clauses = self.cut(delta)
        for clause in clauses:
            self.put(clause)
        return clauses

    def end(self, error: BaseException | None = None) -> None:
        """The streamed text is complete: its rest is queued, then the item of no text that ends
        the stream. With `error`: nothing more is queued, and the consumer gets `error` raised
        after the clauses queued before it."""
        if error is None:
            for clause in self.cut_rest():
                self.put(clause)
            self.put("", final=True)  # flushes the resampler's tail
        self._texts.put_nowait(error)  # (None: the end)

    def whole(self, text: str) -> list[str]:
        """A whole text: all its clauses are queued, the last one final, and the text is complete.
        Returns the clauses."""
        clauses = self.cut(text) + self.cut_rest()
        for n, clause in enumerate(clauses):
            self.put(clause, final=n == len(clauses) - 1)
        self._texts.put_nowait(None)
        return clauses

    # ---- audio out -------------------------------------------------------------
    def __aiter__(self) -> Clauses:
        return self

    async def __anext__(self) -> Clause:
        self._asked += 1
        self._wake.set()
        entry = await self._out.get()
        if entry is None:
            self._out.put_nowait(None)  # (asked again: still the end)
            raise StopAsyncIteration
        if isinstance(entry, BaseException):
            raise entry
        text, final, synthesis = entry
        return Clause(text, final, await synthesis)

    def cancel(self) -> None:
        """Stop: nothing more is submitted, and the item in flight is withdrawn."""
        self._task.cancel()
        if self.last is not None:
            self.last.cancel()

    async def _run(self) -> None:
        """The items one at a time, in order; after each clause, a windowed stream's later windows."""
        submitted = 0
        while (entry := await self._texts.get()) is not None:
            if isinstance(entry, BaseException):
                self._out.put_nowait(entry)
                break
            text, final = entry
            while True:
                while self._ahead is not None and self._asked <= submitted - self._ahead:
                    self._wake.clear()
                    await self._wake.wait()
                self.last = synthesis = asyncio.ensure_future(self._synthesize(TtsItem(self.stream, text, final)))
                submitted += 1
                self._out.put_nowait((text, final, synthesis))
                await asyncio.wait([synthesis])
                if synthesis.cancelled() or synthesis.exception() is not None:
                    self._out.put_nowait(None)  # the consumer stops at the failed item
                    return
                if not self.stream.pending:
                    break
                text = ""
        self._out.put_nowait(None)
