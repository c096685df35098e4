"""Turn recognition (server/hearing/recognition.py) driven by a fake recogniser: segments, deltas,
the transcript, what is submitted for audio, pauses, ends and aborts, and the language a stream
opens with."""

from __future__ import annotations

import asyncio

import pytest
from rtmedia.engines.asr.contract import AsrEvent
from rtmedia.server.hearing.recognition import Delta, Heard, Recognition, Recognizer, Transcribed, Turn
from rtmedia.server.lanes.scheduler import Priority

from tests.support.waits import until


def partial(text: str, delta: str) -> AsrEvent:
    return AsrEvent(0, False, text, delta, 0, 300)


def final(text: str, words: list[tuple[str, int, int, float]] | None = None, end_ms: int = 1000) -> AsrEvent:
    return AsrEvent(0, True, text, "", 0, end_ms, words or [])


class FakeAsr:
    """The ASR handle's surface (server/lanes/access.py Asr): recognize() returns what
    `reply(item, priority)` gives."""

    def __init__(self, reply=None) -> None:
        self.opened: list[dict] = []
        self.languages: list[str] = []  # each opened stream's
        self.closed: list[object] = []
        self.reply = reply

    def open(self, segment: bool = True, fast_final: bool = False, partials: bool = True,
             prompt: str = "", language: str = "") -> object:
        self.opened.append({"segment": segment, "fast_final": fast_final})
        self.languages.append(language)
        return f"stream{len(self.opened)}"

    async def close(self, stream: object) -> None:
        self.closed.append(stream)

    async def recognize(self, item, priority: Priority) -> list[AsrEvent]:
        return await self.reply(item, priority)


class Harness:
    """A Recognizer whose submissions return scripted event lists, one list per submission."""

    def __init__(self, *replies: list[AsrEvent], **kwargs) -> None:
        self.replies = list(replies)
        self.submitted: list[tuple[str, bytes, bool, Priority]] = []  # (kind, audio, end, priority)
        self.deltas: list[tuple[Turn, str]] = []
        self.events: list[tuple[Turn, AsrEvent]] = []
        self.completed: list[tuple[Turn, str]] = []
        self.asr = FakeAsr(self.submit)
        self.recognizer = Recognizer(self.asr, notify=self.told, **kwargs)
        self.task = self.recognizer.start("test-asr")

    def told(self, result: Recognition) -> None:
        if isinstance(result, Delta):
            self.deltas.append((result.turn, result.text))
        elif isinstance(result, Heard):
            self.events.append((result.turn, result.event))
        elif isinstance(result, Transcribed):
            self.completed.append((result.turn, result.turn.said))

    async def submit(self, item, priority: Priority) -> list[AsrEvent]:
        self.submitted.append(("end only" if item.only_ends else "audio", item.audio, item.end, priority))
        await asyncio.sleep(0)
        return self.replies.pop(0) if self.replies else []

    async def finish(self) -> None:
        """Let everything queued be submitted, then stop the feed."""
        self.recognizer.stop()
        await asyncio.wait_for(self.task, 1)
        await self.recognizer.close()

    def delta_texts(self) -> list[str]:
        return [d for _, d in self.deltas]


async def test_two_segment_finals_join_into_the_transcript():
    h = Harness([partial("please call", "please call"), final("please call me back", [("please", 0, 300, 0.9),
                                                                                      ("back", 700, 900, 0.8)])],
                [final("thanks", [("thanks", 1200, 1500, 0.7)])], fast_final=True)
    turn = Turn("item_1", input_offset_ms=5000, asr_offset_ms=200)
    r = h.recognizer
    r.send("audio", turn, b"\1\0" * 10)
    r.send("cut", turn)  # a pause: the first segment ends
    r.send("audio", turn, b"\2\0" * 10)
    r.send("end", turn)
    await h.finish()
    # each segment is one utterance: its audio travels with its end
    assert [(audio, end) for _, audio, end, _ in h.submitted] == [(b"\1\0" * 10, True), (b"\2\0" * 10, True)]
    assert turn.transcript.result() == "please call me back thanks"
    assert h.completed == [(turn, "please call me back thanks")]
    assert h.delta_texts() == ["please call", " me back", " thanks"]
    assert turn.words == [("please", 4800, 5100, 0.9), ("back", 5500, 5700, 0.8), ("thanks", 6000, 6300, 0.7)]
    assert h.asr.opened == [{"segment": False, "fast_final": True}] and h.asr.closed == ["stream1"]


@pytest.mark.parametrize("sent,revised", [
    ("please fall", "please call me"),  # a word already sent changed
    ("please call", "please caller"),  # the final continues the last word sent: not a new word
])
async def test_a_final_that_revises_sent_deltas_adds_no_delta(sent, revised):
    h = Harness([partial(sent, sent)], [final(revised)])
    turn = Turn("item_1")
    h.recognizer.send("audio", turn, b"\0\0" * 10)
    await until(lambda: h.events, what="the partial")  # the partial arrives before the end is queued
    h.recognizer.send("end", turn)
    await h.finish()
    assert h.delta_texts() == [sent]  # nothing more: the transcript decides
    assert turn.partial == sent
    assert turn.transcript.result() == revised


async def test_deltas_concatenate_with_spaces():
    h = Harness([partial("hello", "hello"), partial("hello there", "there")], [final("hello there my friend")])
    turn = Turn("item_1")
    h.recognizer.send("audio", turn, b"\0\0" * 10)
    await until(lambda: len(h.events) == 2, what="both partials")
    h.recognizer.send("end", turn)
    await h.finish()
    assert h.delta_texts() == ["hello", " there", " my friend"]
    assert "".join(h.delta_texts()) == "hello there my friend" == turn.transcript.result()
    assert [e.is_final for _, e in h.events] == [False, False, True]  # every event reaches on_event


async def test_a_pause_sends_an_end_only_item_and_a_closed_segment_sends_nothing():
    h = Harness([partial("one", "one")], [final("one two")], priority=Priority.INTERACTIVE)
    turn = Turn("item_1")
    h.recognizer.send("audio", turn, b"\0\0" * 10)
    await until(lambda: h.events, what="the audio's partial")  # the audio went alone: the segment is open
    h.recognizer.send("cut", turn)  # ends it with no audio
    h.recognizer.send("cut", turn)  # a second pause: nothing left to end
    h.recognizer.send("end", turn)  # nor here: the turn completes from its segments
    await h.finish()
    assert [(kind, audio, end) for kind, audio, end, _ in h.submitted] == \
        [("audio", b"\0\0" * 10, False), ("end only", b"", True)]
    assert {priority for *_, priority in h.submitted} == {Priority.INTERACTIVE}
    assert h.completed == [(turn, "one two")] and turn.transcript.result() == "one two"


async def test_an_aborted_turn_reports_nothing():
    h = Harness([partial("dropped", "dropped"), final("dropped")], [partial("kept", "kept"), final("kept")])
    cleared, kept = Turn("item_1"), Turn("item_2")
    h.recognizer.send("audio", cleared, b"\0\0" * 10)
    h.recognizer.send("abort", cleared)
    h.recognizer.send("audio", kept, b"\1\0" * 10)
    h.recognizer.send("end", kept)
    await h.finish()
    assert [end for _, _, end, _ in h.submitted] == [True, True]  # the recogniser still forgets the turn
    assert not cleared.transcript.done() and cleared.segments == []
    assert [turn for turn, _ in h.events] == [kept, kept] and h.delta_texts() == ["kept"]
    assert h.completed == [(kept, "kept")]


async def test_a_turn_without_audio_completes_empty_without_opening_a_stream():
    h = Harness()
    turn = Turn("item_1")
    h.recognizer.send("end", turn)
    await h.finish()
    assert h.submitted == [] and h.asr.opened == [] and h.asr.closed == []
    assert turn.transcript.result() == "" and h.completed == [(turn, "")]


async def test_the_stream_opens_in_the_language_and_a_new_one_takes_a_new_stream_from_the_next_segment():
    h = Harness([final("bonjour", [("bonjour", 100, 400, 0.9)], end_ms=500)],
                [partial("hallo", "hallo")], [final("hallo welt", [("hallo", 50, 300, 0.9)], end_ms=400)],
                language="fr")
    first, second = Turn("item_1"), Turn("item_2", input_offset_ms=2000, asr_offset_ms=1000)
    h.recognizer.send("audio", first, b"\0\0" * 16000)  # one second
    h.recognizer.send("end", first)
    await asyncio.wait_for(first.transcript, 1)
    h.recognizer.language = "de"  # a session.update: from the next segment on
    h.recognizer.send("audio", second, b"\0\0" * 8000)
    await until(lambda: len(h.events) == 2, what="the second segment's partial")
    # the segment is open: the language stays until it ends
    h.recognizer.language = "en"
    h.recognizer.send("end", second)
    await h.finish()
    assert h.asr.languages == ["fr", "de"] and h.asr.closed == ["stream1", "stream2"]
    assert second.transcript.result() == "hallo welt"
    # the new stream's offsets count the audio of the one before: the turn's words are where they were said
    assert second.segments[0].start_ms == 1000 and second.words == [("hallo", 2050, 2300, 0.9)]
    assert first.words == [("bonjour", 100, 400, 0.9)]


async def test_a_recogniser_failure_fails_the_task():
    async def broken(item, priority):
        raise RuntimeError("worker died")

    recognizer = Recognizer(FakeAsr(broken))
    task = recognizer.start("test-asr")
    recognizer.send("audio", Turn("item_1"), b"\0\0")
    with pytest.raises(RuntimeError, match="worker died"):
        await asyncio.wait_for(task, 1)
    await recognizer.close()  # still frees the stream, and does not raise
