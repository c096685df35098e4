"""server/lanes/clauses.py on a fake synthesis: clauses in order, streamed clauses as they complete,
one item at a time with the next synthesising while one is consumed (and Synthesize's bound of one
ahead), the closing item, a windowed stream's later windows, errors raised at their clause, and
cancelling."""

from __future__ import annotations

import asyncio

import pytest
from rtmedia.engines.base import EngineError
from rtmedia.engines.tts.piper import TtsItem
from rtmedia.server.lanes.clauses import Clause, Clauses


class FakeStream:
    """What Clauses reads of a TTS stream: whether a windowed sentence has frames left."""

    def __init__(self) -> None:
        self.pending = False


class FakeTts:
    """Each item's synthesis is a future the test resolves (or `auto`: at once, its text as audio)."""

    def __init__(self, auto: bool = False, fail: str | None = None) -> None:
        self.auto = auto
        self.fail = fail  # the clause whose synthesis fails
        self.items: list[tuple[str, bool]] = []
        self.futures: list[asyncio.Future[bytes]] = []

    def synthesize(self, item: TtsItem) -> asyncio.Future[bytes]:
        self.items.append((item.text, item.final))
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        if item.text == self.fail:
            future.set_exception(EngineError("the voice failed"))
        elif self.auto:
            future.set_result(item.text.encode())
        return future

    def resolve(self, n: int) -> None:
        self.futures[n].set_result(self.items[n][0].encode())

    @property
    def texts(self) -> list[str]:
        return [text for text, _ in self.items]


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_whole_texts_clauses_come_in_order_and_its_last_is_final():
    tts = FakeTts(auto=True)
    clauses = Clauses(FakeStream(), tts.synthesize)  # type: ignore[arg-type]
    cut = clauses.whole("Hello there, how are you today? I am fine.")
    got = [clause async for clause in clauses]
    assert cut == ["Hello there,", "how are you today?", "I am fine."]
    assert got == [Clause("Hello there,", False, b"Hello there,"),
                   Clause("how are you today?", False, b"how are you today?"),
                   Clause("I am fine.", True, b"I am fine.")]
    assert tts.items == [(c.text, c.final) for c in got]  # no closing item for a whole text
    clauses.cancel()


async def test_a_streamed_texts_clauses_come_as_they_complete_and_end_with_the_closing_item():
    tts = FakeTts(auto=True)
    clauses = Clauses(FakeStream(), tts.synthesize)  # type: ignore[arg-type]
    assert clauses.feed("Hello there, ho") == ["Hello there,"]
    first = await asyncio.wait_for(anext(clauses), 1)
    assert first == Clause("Hello there,", False, b"Hello there,")  # before the rest of the text exists
    assert clauses.feed("w are") == []
    await settle()
    assert tts.texts == ["Hello there,"]
    clauses.feed(" you? Fine")
    assert (await anext(clauses)).text == "how are you?"
    clauses.end()  # the rest, then the item of no text that flushes the resampler
    rest = [clause async for clause in clauses]
    assert [(c.text, c.final) for c in rest] == [("Fine", False), ("", True)]
    assert tts.items == [("Hello there,", False), ("how are you?", False), ("Fine", False), ("", True)]
    clauses.cancel()


async def test_the_next_clause_is_submitted_once_the_one_before_is_synthesised_before_it_is_consumed():
    tts = FakeTts()
    clauses = Clauses(FakeStream(), tts.synthesize)  # type: ignore[arg-type]
    clauses.whole("One, two, three, four.")
    await settle()
    assert tts.texts == ["One,"]  # one item at a time: the stream is stateful
    tts.resolve(0)
    await settle()
    assert tts.texts == ["One,", "two,"]  # synthesising while nobody has taken clause 0 yet
    assert (await anext(clauses)).audio == b"One,"
    tts.resolve(1)
    await settle()
    assert tts.texts == ["One,", "two,", "three,"]  # no bound: the consumer paces itself
    clauses.cancel()


async def test_ahead_one_synthesises_one_clause_beyond_the_one_consumed():
    tts = FakeTts(auto=True)
    clauses = Clauses(FakeStream(), tts.synthesize, ahead=1)  # type: ignore[arg-type]
    clauses.whole("One, two, three, four.")
    await settle()
    assert tts.texts == ["One,"]
    assert (await anext(clauses)).text == "One,"
    await settle()
    assert tts.texts == ["One,", "two,"]  # clause 1 synthesises while clause 0 is being sent
    assert (await anext(clauses)).text == "two,"
    await settle()
    assert tts.texts == ["One,", "two,", "three,"]
    assert [c.text async for c in clauses] == ["three,", "four."]
    clauses.cancel()


async def test_a_windowed_sentence_goes_on_as_items_of_no_text_before_the_next_clause():
    tts, stream = FakeTts(), FakeStream()
    clauses = Clauses(stream, tts.synthesize)  # type: ignore[arg-type]
    clauses.whole("A long sentence, then more.")
    await settle()
    stream.pending = True
    tts.resolve(0)
    await settle()
    stream.pending = False
    tts.resolve(1)
    await settle()
    tts.resolve(2)
    got = [(c.text, c.final) async for c in clauses]
    assert got == [("A long sentence,", False), ("", False), ("then more.", True)]
    assert tts.items == got
    clauses.cancel()


async def test_a_failed_synthesis_is_raised_at_its_clause_and_nothing_after_it_is_submitted():
    tts = FakeTts(auto=True, fail="two,")
    clauses = Clauses(FakeStream(), tts.synthesize)  # type: ignore[arg-type]
    clauses.whole("One, two, three, four.")
    assert (await anext(clauses)).text == "One,"
    with pytest.raises(EngineError, match="the voice failed"):
        await anext(clauses)
    assert [c async for c in clauses] == []  # then the iteration ends
    assert tts.texts == ["One,", "two,"]
    clauses.cancel()


async def test_an_error_the_text_ends_with_comes_after_the_clauses_before_it():
    tts = FakeTts(auto=True)
    clauses = Clauses(FakeStream(), tts.synthesize)  # type: ignore[arg-type]
    clauses.feed("Hello there, how")
    clauses.end(ValueError("the text is too long"))
    assert (await anext(clauses)).text == "Hello there,"
    with pytest.raises(ValueError, match="too long"):
        await anext(clauses)
    assert tts.texts == ["Hello there,"]  # no rest, no closing item
    clauses.cancel()


async def test_cancelling_withdraws_the_item_in_flight_and_submits_nothing_more():
    tts = FakeTts()
    clauses = Clauses(FakeStream(), tts.synthesize)  # type: ignore[arg-type]
    clauses.feed("One, two, three,")
    await settle()
    assert tts.texts == ["One,"]
    clauses.cancel()
    await settle()
    assert tts.futures[0].cancelled()
    clauses.feed(" four, five.")
    clauses.end()
    await settle()
    assert tts.texts == ["One,"]
