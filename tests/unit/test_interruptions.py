"""Confirmed interruptions' judgement (server/session/interruptions.py): backchannels, runs of them, and
words or voice that interrupt."""

from __future__ import annotations

import pytest
from rtmedia.engines.asr.contract import normal_words
from rtmedia.server.session.interruptions import BACKCHANNELS, Interruption, Voice, is_backchannel

PHRASES = Interruption().phrases


@pytest.mark.parametrize("text", ["Mm-hmm.", "Yeah.", "yeah okay sure", "Yeah, okay, sure.", "Uh-huh.", "Aha",
                                  "Okay, got it.", "Yes, I see.", "right right", "All right."])
def test_backchannels_and_runs_of_them(text):
    assert is_backchannel(normal_words(text), PHRASES)


@pytest.mark.parametrize("text", ["", "Stop.", "Wait, stop.", "Yeah, but wait.", "Hold on.", "okay stop",
                                  "No, that is wrong.", "see"])
def test_words_that_are_not_backchannels(text):
    assert not is_backchannel(normal_words(text), PHRASES)


def voice(**settings) -> Voice:
    return Voice("item_1", 0, None, 0.0, Interruption(mode="confirmed", **settings))


def test_a_verdict_comes_from_words_or_from_voice_that_lasts():
    v = voice()
    assert v.verdict("Stop.", 300, final=False) == "interrupt"  # one word that is not a backchannel
    assert v.verdict("Yeah, okay", 300, final=False) is None  # undecided while it goes on ...
    assert v.verdict("Yeah, okay", 300, final=True) == "backchannel"  # ... not an interruption at its pause
    assert v.verdict("", 300, final=True) == "backchannel"  # a sound without words
    assert v.verdict("", 1600, final=False) == "interrupt"  # long voice, nothing recognised yet
    assert v.verdict("yeah yeah yeah okay right sure", 4000, final=False) is None  # long, but backchannels
    assert v.verdict("yeah but wait", 500, final=False) == "interrupt"
    # While the voice goes on, the beginning of a backchannel is not yet a word that interrupts.
    assert v.verdict("I", 300, final=False) is None and v.verdict("Yeah, of", 300, final=False) is None
    assert v.verdict("Sur", 300, final=False) is None and v.verdict("I", 300, final=True) == "interrupt"
    assert v.verdict("Stop", 300, final=False) == "interrupt"
    two = voice(min_words=2)
    assert two.verdict("Stop.", 300, final=False) is None and two.verdict("Stop.", 300, final=True) == "backchannel"
    assert two.verdict("Stop it.", 300, final=False) == "interrupt"
    own = voice(backchannels=("go on",))
    assert own.verdict("go on", 300, final=True) == "backchannel" and own.verdict("yeah", 300, final=True)


def test_a_partial_hypothesis_counts_once_the_next_agrees_or_it_holds_a_word_that_interrupts():
    v = voice()
    v.hear("Cheers!")  # "Sure." a quarter second in
    assert v.verdict(v.heard, 300, final=False) is None
    v.hear("Sure.")
    assert v.verdict(v.heard, 500, final=False) is None and v.verdict("Sure.", 500, final=True) == "backchannel"
    asking = voice()
    asking.hear("can you")
    assert asking.verdict(asking.heard, 300, final=False) is None
    asking.hear("Can you repeat")
    assert asking.verdict(asking.heard, 800, final=False) == "interrupt"  # "can you" agreed
    for text in ("wait it", "No,", "hang on", "Yeah, but"):
        hurried = voice()
        hurried.hear(text)
        assert hurried.verdict(hurried.heard, 250, final=False) == "interrupt", text


def test_the_default_list_reads_as_the_recogniser_writes():
    assert all(normal_words(p) for p in BACKCHANNELS)
    assert ("mm", "hmm") in PHRASES and ("uh", "huh") in PHRASES  # "Mm-hmm.", "Uh-huh."
