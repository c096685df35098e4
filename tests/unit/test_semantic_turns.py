"""semantic_vad's decisions (server/hearing/semantic_turns.py), with the scorers stood in for: a pause ends
its turn at a candidate point whose threshold its words' score reaches, and only there; words are
scored once; a doubtful last word holds a pause open until 1.5 s; a pause with no words never ends early; without a score the pause ends at
silence_duration_ms (reason silence); the acoustic scorer, when loaded, can hold a turn back; the
server's own thresholds replace the defaults."""

from __future__ import annotations

import asyncio
import dataclasses

from rtmedia.server.hearing.audio_input import Stop
from rtmedia.server.hearing.recognition import Turn
from rtmedia.server.hearing.semantic_turns import SemanticTurns
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.session.config import SessionSettings


class StandInTurns:
    """engine_access.Turns as far as SemanticTurns uses it: fixed scores, counted."""

    available = True

    def __init__(self, scores: dict[str, float | None], hears: float | None = None) -> None:
        self.scores, self.heard, self.calls = scores, hears, []
        self.hears = hears is not None

    async def score(self, responder, key, assistant, words):
        self.calls.append(("score", words))
        return self.scores[words]

    def forget(self, key) -> None:
        self.calls.append(("forget", key))

    async def hear(self, audio) -> float:
        self.calls.append(("hear", len(audio)))
        return self.heard


async def decide(turns: StandInTurns, words: str, silences: list[int], thresholds=None, confidence: float = 1.0,
                 before: tuple[str, ...] = (), **settings) -> list[Stop]:
    """The stops asked for at each candidate point of one pause whose words are `words` (the
    last one heard with `confidence`), after segments of the turn cut at earlier pauses (`before`)."""
    stops: list[Stop] = []
    tasks: set[asyncio.Task] = set()
    current = dataclasses.replace(SessionSettings(), turn_type="semantic_vad", **settings)

    def spawn(coro, name):
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        return task

    semantic = SemanticTurns("s", turns, Metrics(), lambda: current, lambda decided: stops.append(decided.stop), spawn,
                             thresholds)
    semantic.started("How can I help?")
    semantic.audio(b"\x00\x01" * 1600)
    turn = Turn("item_1")
    turn.cut_done = asyncio.get_running_loop().create_future()
    semantic.paused(turn)
    heard = [(w, 0, 0, 1.0) for w in words.split()]
    if heard:
        heard[-1] = (heard[-1][0], 0, 0, confidence)
    for text in (*before, words):
        turn.segments.append(type("Final", (), {"text": text, "words": heard})())
    turn.cut_done.set_result(None)
    for silence in silences:
        semantic.candidate(turn, silence, 1000)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    semantic.ended()
    return stops


async def test_a_finished_pause_ends_at_its_first_candidate_and_words_are_scored_once():
    turns = StandInTurns({"what time is it": -0.5})
    stops = await decide(turns, "what time is it", [224, 512, 608])
    assert stops[0] == Stop(1000, "semantic", -0.5)
    assert [c for c in turns.calls if c[0] == "score"] == [("score", "what time is it")]
    assert turns.calls[-1] == ("forget", ("turn", "s"))


async def test_an_unfinished_pause_waits_until_the_threshold_falls_far_enough():
    # medium: -2.2 before 600 ms, -2.6 from 600 ms, -3.2 from 1.5 s
    assert await decide(StandInTurns({"a table for": -3.0}), "a table for", [224, 512, 608]) == []
    stops = await decide(StandInTurns({"a table for": -3.0}), "a table for", [224, 608, 1504])
    assert stops == [Stop(1000, "semantic", -3.0)]  # at 1.5 s only
    high = await decide(StandInTurns({"a table for": -3.0}), "a table for", [224, 608], eagerness="high")
    assert high == [Stop(1000, "semantic", -3.0)]
    own = await decide(StandInTurns({"a table for": -3.0}), "a table for", [224], thresholds={"medium": (-3.5, -4, -5)})
    assert own == [Stop(1000, "semantic", -3.0)]


async def test_a_doubtful_last_word_holds_the_pause_open_until_the_words_as_heard_decide():
    # "how tall is the", heard as "how tall is that": finished only with the word the recogniser doubts
    scores = {"how tall is that": -0.3, "how tall is": -4.0}
    turns = StandInTurns(scores)
    assert await decide(turns, "how tall is that", [224, 608], confidence=0.5) == []
    assert {c for c in turns.calls if c[0] == "score"} == {("score", "how tall is that"), ("score", "how tall is")}
    stops = await decide(StandInTurns(scores), "how tall is that", [224, 608, 1504], confidence=0.5)
    assert stops == [Stop(1000, "semantic", -0.3)]  # at 1.5 s
    sure = StandInTurns(scores)
    assert await decide(sure, "how tall is that", [224], confidence=0.9) == [Stop(1000, "semantic", -0.3)]
    assert ("score", "how tall is") not in sure.calls


async def test_a_turn_that_went_on_after_a_pause_is_scored_as_one_sentence():
    """The recogniser closed the first segment as a question; speech went on: the scorer reads the
    turn as one sentence, not "What is the weather like in? Paris this weekend." """
    turns = StandInTurns({"What is the weather like in Paris this weekend.": -0.4})
    stops = await decide(turns, "Paris this weekend.", [224], before=("What is the weather like in?",))
    assert stops == [Stop(1000, "semantic", -0.4)]


async def test_noise_never_ends_a_turn_early_and_no_score_falls_back_to_the_silence_rule():
    assert await decide(StandInTurns({}), "", [224, 512, 608]) == []
    stops = await decide(StandInTurns({"so": None}), "so", [224, 512, 608])
    assert stops == [Stop(1000, "silence"), Stop(1000, "silence")]  # from silence_duration_ms on
    off = await decide(StandInTurns({}), "", [224, 512], transcription=False)
    assert off == [Stop(1000, "silence")]


async def test_the_acoustic_scorer_can_hold_a_turn_back():
    assert await decide(StandInTurns({"what time is it": -0.5}, hears=0.2), "what time is it", [224]) == []
    turns = StandInTurns({"what time is it": -0.5}, hears=0.9)
    assert await decide(turns, "what time is it", [224]) == [Stop(1000, "semantic", -0.5)]
    assert ("hear", 1600) in turns.calls
