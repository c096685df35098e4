"""Preemptive replies (docs/protocol.md#preemptive-replies) and response.timings, in-process with
the real engines and the echo responder: a reply prepared at the user's pause is committed
when the turn ends with the same words (its first audio was synthesised before the turn
ended), discarded unseen when the user speaks on, and never prepared when the session turns it
off; every response.done carries its stages. (A bad `preemptive` in the Realtime API:
test_openai_realtime.py's refused fields.)"""

from __future__ import annotations

import numpy as np

from tests.support.converse import Conversation
from tests.support.speech import wer

RATE = 24000
SENTENCE = "Please remember to buy milk and bread on your way home."
FIRST, SECOND = "Please call me back tomorrow afternoon.", "And bring the blue folder."
# A long end-of-turn silence: time enough after the early final (160 ms in) to prepare the reply
# on a loaded CI machine; the pause inside the discarded turn is well short of it.
SILENCE_MS = 1200
STAGES = ("turn_detection_ms", "transcription_ms", "first_text_ms", "first_audio_ms")


def preempted(server) -> dict[str, float]:
    metrics = server.scheduler.metrics
    counts = {outcome: metrics.preemptive.labels(outcome)._value.get() for outcome in ("started", "committed",
                                                                                       "discarded")}
    return {**counts, "discarded_audio_s": metrics.preemptive_discarded_audio._value.get()}


def check_timings(done: dict) -> dict:
    """The stages are there, none negative, and they sum to at most voice-to-voice."""
    timings = done["timings"]
    assert all(timings[name] >= 0 for name in (*STAGES, "voice_to_voice_ms")), timings
    assert sum(timings[name] for name in STAGES) <= timings["voice_to_voice_ms"] + 2, timings
    # the server's view of the end of speech: at least the silence it waited
    assert timings["turn_detection_ms"] >= SILENCE_MS - 100, timings
    return timings


def spoken(speaker, *parts: str) -> bytes:
    """The parts spoken with 0.8 s between them (a pause, not the turn's end), then the turn's end."""
    audio = [speaker.silence(0.5, RATE)]
    for part in parts:
        audio += [speaker.say(part, RATE), speaker.silence(0.8, RATE)]
    return np.concatenate([*audio, speaker.silence(SILENCE_MS / 1000, RATE)]).tobytes()


async def converse(channel, pcm: bytes, **turn) -> Conversation:
    c = await Conversation(channel).__aenter__()
    c.send("session.update", session={"turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS,
                                                         **turn}})
    await c.wait_for("session.updated")
    await c.stream(pcm, RATE)
    await c.wait_for("response.done", timeout=30)
    return c


def only_one_response(c: Conversation) -> str:
    """Every response event names the one response created."""
    (created,) = c.of_type("response.created")
    rid = created["response_id"]
    assert {e["response_id"] for e in c.events if e["type"].startswith("response.") and "response_id" in e} == {rid}
    return rid


async def test_a_reply_prepared_at_the_pause_is_sent_when_the_turn_ends(server, channel, speaker):
    pcm = spoken(speaker, SENTENCE)
    before = preempted(server)
    c = await converse(channel, pcm)
    try:
        only_one_response(c)
        done = c.of_type("response.done")[0]
        assert done["status"] == "completed"
        timings = check_timings(done)
        # Committed: its first clause was synthesised during the silence, so no synthesis is waited for.
        assert timings["preemptive"] == "committed" and timings["first_audio_ms"] == 0, timings
        said = c.of_type("conversation.item.input_audio_transcription.completed")[0]["transcript"]
        assert wer(SENTENCE, said) < 0.3 and c.of_type("response.output_text.done")[0]["text"] == f"You said: {said}"
        order = c.types()
        assert order.index("input_audio_buffer.speech_stopped") < order.index("response.created") \
            < order.index("response.output_text.delta") < order.index("response.output_audio.delta")
    finally:
        await c.__aexit__(None, None, None)
    after = preempted(server)
    assert after["committed"] - before["committed"] == 1 and after["discarded"] == before["discarded"]


async def test_a_user_who_speaks_on_after_the_pause_gets_one_reply_to_all_of_it(server, channel, speaker):
    pcm = spoken(speaker, FIRST, SECOND)
    before = preempted(server)
    c = await converse(channel, pcm)
    try:
        rid = only_one_response(c)
        (completed,) = c.of_type("conversation.item.input_audio_transcription.completed")
        assert wer(f"{FIRST} {SECOND}", completed["transcript"]) < 0.3, completed["transcript"]
        assert c.of_type("response.output_text.done")[0]["text"] == f"You said: {completed['transcript']}"
        timings = check_timings(c.of_type("response.done")[0])
        assert timings["preemptive"] in ("committed", "none")  # the second pause's reply may be the one sent
        # The history: one user turn, one reply (the prepared reply's words never joined it).
        session = next(x for x in server.realtime.sessions.values() if x.response and x.response.response_id == rid)
        assert [(m.role, m.item_id) for m in session.history] == [
            ("user", completed["item_id"]), ("assistant", c.of_type("response.created")[0]["item_id"])]
    finally:
        await c.__aexit__(None, None, None)
    after = preempted(server)
    assert after["started"] - before["started"] >= 1 and after["discarded"] - before["discarded"] >= 1, (before, after)
    assert after["discarded_audio_s"] > before["discarded_audio_s"]  # its first clause had been synthesised


async def test_preemptive_off_prepares_nothing_and_the_timings_say_none(server, channel, speaker):
    pcm = spoken(speaker, SENTENCE)
    before = preempted(server)
    c = await converse(channel, pcm, preemptive=False)
    try:
        assert c.of_type("session.updated")[0]["session"]["turn_detection"]["preemptive"] is False
        timings = check_timings(c.of_type("response.done")[0])
        assert timings["preemptive"] == "none" and timings["first_audio_ms"] > 0, timings
    finally:
        await c.__aexit__(None, None, None)
    assert preempted(server) == before


async def test_a_prepared_reply_to_other_words_is_made_again_for_the_transcript(server, channel, speaker,
                                                                                 monkeypatch):
    """The final's words differ from those the prepared reply answers (here: made to differ):
    the reply is made afresh for the transcript, and nothing of the prepared one is seen."""
    from rtmedia.server.session.reply import ReplyPipeline

    preempt = ReplyPipeline.preempt
    monkeypatch.setattr(ReplyPipeline, "preempt", lambda self, turn, said, request: preempt(
        self, turn, "something else entirely", request))
    pcm = spoken(speaker, SENTENCE)
    before = preempted(server)
    c = await converse(channel, pcm)
    try:
        only_one_response(c)
        said = c.of_type("conversation.item.input_audio_transcription.completed")[0]["transcript"]
        assert c.of_type("response.output_text.done")[0]["text"] == f"You said: {said}"
        assert "".join(e["delta"] for e in c.of_type("response.output_text.delta")) == f"You said: {said}"
        timings = check_timings(c.of_type("response.done")[0])
        assert timings["preemptive"] == "none", timings
    finally:
        await c.__aexit__(None, None, None)
    after = preempted(server)
    assert after["discarded"] - before["discarded"] == 1 and after["committed"] == before["committed"]
