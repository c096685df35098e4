"""A Session's turn and reply machine, driven in fake time (docs/protocol.md#turns, #interruptions,
#preemptive-replies, #tools): barge-in at the heard point, a backchannel and a confirmed interruption
over a reply, a preemptive reply committed and discarded, a function call's wait (its filler, its
answer, its timeout) and an idle turn.

The session is the real one; its engines are tests/support/fake_engines.py's (scripted transcripts
and replies, a tone for speech at 200 ms a word), its clock tests/support/fake_clock.py's, and the
test plays the VAD tick (`Session.on_audio` with the tick's actions) and the client (`handle`,
and reading the outbox as the writer would). Nothing sleeps: each test runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from rtmedia.engines.responders.contract import CallDelta
from rtmedia.protocol.events import client_event, to_json
from rtmedia.server.hearing.audio_input import Stop
from rtmedia.server.session.config import SessionSettings
from rtmedia.server.session.limits import Limits
from rtmedia.server.session.session import Session, SessionContext

from tests.support.fake_clock import FakeClock
from tests.support.fake_engines import FakeEngines, FakeTts

Event = tuple[str, dict[str, Any]]
MS_PER_WORD = 200  # the fake voice's pace


def words(text: str) -> list[str]:
    """`text` as a responder streams it: a word per delta, each but the last with its space."""
    split = text.split()
    return [w if n == len(split) - 1 else w + " " for n, w in enumerate(split)]


class Call:
    """One session in fake time, its engines faked; the test is its VAD tick and its client."""

    def __init__(self, settings: SessionSettings | None = None) -> None:
        self.engines = FakeEngines(tts=FakeTts(ms_per_word=MS_PER_WORD))
        self.clock = FakeClock()
        context = SessionContext(access=self.engines.access, limits=Limits(), max_sessions=1, lm_slots=1,
                                 clock=self.clock)
        self.session = Session("sess_machine", context, settings or SessionSettings())
        self.events: list[Event] = []  # everything the client has read so far
        self.at_ms = 0  # where the user's input is (the VAD tick's offsets)

    # ---- the client ----------------------------------------------------------
    def send(self, name: str, /, **fields: Any) -> None:
        self.session.handle(client_event(name, **fields))

    async def read(self) -> list[Event]:
        """What the writer would send now (media of a cancelled response's epoch dropped, as it
        drops them), as (name, fields); also kept in `events`."""
        await self.clock.settle()
        got = []
        while (event := await self._next()) is not None:
            fields = to_json(event)
            got.append((fields.pop("type"), fields))
        self.events += got
        return got

    async def _next(self) -> Any:
        """The outbox's next event if it has one for the writer now, else None (no waiting)."""
        getting = asyncio.ensure_future(self.session.outbox.get(self.session.replies.epoch))
        await asyncio.sleep(0)  # one step: `get` returns at once when it holds an event to send
        if getting.done():
            return getting.result()
        getting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await getting
        return None

    async def tick(self, ms: float) -> list[Event]:
        """`ms` pass on the session's clock; what the client reads meanwhile."""
        await self.clock.advance(ms)
        return await self.read()

    # ---- the VAD tick ----------------------------------------------------------
    def started(self) -> None:
        self.session.on_audio([("started", self.at_ms)])

    def audio(self, ms: int) -> None:
        """`ms` of the user's voice reach the recogniser (16 kHz PCM16)."""
        self.session.on_audio([("audio", (self.at_ms, b"\x10\x00" * 16 * ms))])
        self.at_ms += ms

    def paused(self) -> None:
        self.session.on_audio([("pause", None)])

    def stopped(self) -> None:
        self.session.on_audio([("stopped", Stop(self.at_ms, silence_ms=500))])

    async def turn(self, said: str, ms: int = 800) -> list[Event]:
        """The user says `said` (the recogniser's transcript of it) in `ms`, and the turn ends."""
        self.engines.asr.say(said)
        self.started()
        self.audio(ms)
        self.stopped()
        return await self.read()

    # ---- reading what came ----------------------------------------------------
    def named(self, name: str, events: list[Event] | None = None) -> list[dict[str, Any]]:
        return [fields for n, fields in (self.events if events is None else events) if n == name]

    def audio_ms(self, response_id: str, events: list[Event] | None = None) -> int:
        """Reply audio the client got for `response_id`, in ms."""
        deltas = [f for f in self.named("response.output_audio.delta", events) if f["response_id"] == response_id]
        return sum(len(f["audio"]) * 3 // 4 for f in deltas) * 1000 // (2 * self.engines.tts.rate)

    def done(self, response_id: str) -> dict[str, Any]:
        (done,) = [f for f in self.named("response.done") if f["response_id"] == response_id]
        return done

    def counted(self, metric: str, **labels: str) -> float:
        return self.engines.metrics.registry.get_sample_value(metric, labels) or 0.0

    async def reply_playing(self, reply: str, said: str = "Tell me about Paris.") -> str:
        """A turn whose reply is `reply`; the reply's response id, its first audio out."""
        self.engines.replies.add(*words(reply))
        await self.turn(said)
        (created,) = self.named("response.created")[-1:]
        assert self.audio_ms(created["response_id"]) > 0
        return str(created["response_id"])


@pytest.fixture
async def call() -> AsyncIterator[Call]:
    call = Call()
    yield call
    await call.read()
    await call.session.close()
    assert not call.named("error"), call.named("error")  # no refused event, no failed session task
    failed = [f for f in call.named("response.done") if f["status"] == "failed"]
    assert not failed, failed


LONG_REPLY = "Paris is lovely in the spring. The museums stay open late on Fridays."  # 2.6 s
# Its clauses (engines/tts/text_chunks.py): "Paris is lovely" 0-600 ms, "in the spring." 600-1200 ms,
# "The museums stay open late on Fridays." 1200-2600 ms.


async def test_a_barge_in_cancels_the_reply_and_keeps_it_in_the_history_to_the_heard_point(call: Call):
    rid = await call.reply_playing(LONG_REPLY)
    # Reply audio goes out at most 1 s ahead of playback: 1.2 s at once, then as it plays.
    assert call.audio_ms(rid) == 1200
    await call.tick(700)
    assert call.audio_ms(rid) == 1800
    call.send("playback.ack", response_id=rid, played_ms=900)
    call.engines.asr.say("What about London?")
    call.started()
    barge = await call.read()
    names = [n for n, _ in barge]
    assert names == ["playback.acknowledged", "input_audio_buffer.speech_started", "output_audio_buffer.cleared",
                     "response.done"]
    assert call.named("output_audio_buffer.cleared", barge)[0]["audio_end_ms"] == 1800
    done = call.done(rid)
    assert (done["status"], done["status_reason"]) == ("cancelled", "turn_detected")
    # Nothing more of the cancelled reply reaches the client, however long it would have played.
    assert call.audio_ms(rid, await call.tick(3000)) == 0
    # The history keeps the reply as far as it was heard: the first clause, and of the second the
    # played fraction (300 of its 600 ms: one word and a half) cut at a word boundary.
    call.engines.replies.add(*words("London is rainy."))
    call.audio(600)
    call.stopped()
    await call.read()
    item_id = call.named("response.created")[0]["item_id"]
    call.send("conversation.item.retrieve", item_id=item_id)
    (retrieved,) = call.named("conversation.item.retrieved", await call.read())
    assert retrieved["item"]["text"] == "Paris is lovely in"
    answer = call.engines.replies.requests[-1].history
    assert [(m.role, m.text) for m in answer] == [("user", "Tell me about Paris."), ("assistant", "Paris is lovely in"),
                                                  ("user", "What about London?")]


async def test_a_barge_in_after_the_reply_was_all_sent_truncates_it_in_the_history(call: Call):
    rid = await call.reply_playing("Paris is lovely in the spring.")  # 1.2 s, all sent at once
    assert call.audio_ms(rid) == 1200 and call.done(rid)["status"] == "completed"
    await call.tick(700)
    call.send("playback.ack", response_id=rid, played_ms=700)
    call.engines.asr.say("And London?")
    call.started()  # still playing at the client: a barge-in
    barge = [n for n, _ in await call.read()]
    assert barge == ["playback.acknowledged", "input_audio_buffer.speech_started", "output_audio_buffer.cleared"]
    assert len(call.named("response.done")) == 1  # it had its response.done already
    call.audio(500)
    call.stopped()
    await call.read()
    history = call.engines.replies.requests[-1].history
    assert [m.text for m in history] == ["Tell me about Paris.", "Paris is lovely", "And London?"]


async def confirmed(call: Call) -> None:
    call.send("session.update", session={"turn_detection": {"interruption": {"mode": "confirmed"}}})
    (updated,) = call.named("session.updated", await call.read())
    assert updated["session"]["turn_detection"]["interruption"]["mode"] == "confirmed"


async def test_a_backchannel_during_a_reply_is_no_turn_and_the_reply_goes_on(call: Call):
    await confirmed(call)
    rid = await call.reply_playing(LONG_REPLY)
    await call.tick(300)
    call.engines.asr.say("Mhm.")
    call.started()
    (tentative,) = call.named("input_audio_buffer.speech_tentative", await call.read())
    assert tentative["response_id"] == rid
    # While the voice is judged the reply's audio stops going out (the client plays what it has).
    call.audio(400)
    assert call.audio_ms(rid, await call.tick(400)) == 0
    assert call.audio_ms(rid, await call.tick(400)) == 0
    call.paused()  # its early final, "Mhm.", is all backchannel: the reply resumes
    (backchannel,) = call.named("input_audio_buffer.backchannel", await call.read())
    assert (backchannel["transcript"], backchannel["response_id"]) == ("Mhm.", rid)
    assert backchannel["item_id"] == tentative["item_id"]
    call.stopped()
    await call.tick(3000)
    assert call.audio_ms(rid) == 2600  # all of it, from where it paused
    assert call.done(rid)["status"] == "completed"
    # A voice that was no interruption is no turn: no speech_started, commit, transcript or response.
    for name in ("input_audio_buffer.speech_started", "input_audio_buffer.committed",
                 "conversation.item.input_audio_transcription.completed"):
        assert len(call.named(name)) == 1, name  # the first turn's only
    assert not call.named("output_audio_buffer.cleared")
    assert len(call.named("response.created")) == 1
    assert call.counted("rtmedia_interruptions_total", outcome="resumed") == 1
    call.engines.replies.add(*words("Sure."))
    await call.turn("Thanks.")
    assert [m.text for m in call.engines.replies.requests[-1].history] == ["Tell me about Paris.", LONG_REPLY, "Thanks."]


async def test_a_confirmed_interruption_announces_the_turn_and_cancels_the_reply(call: Call):
    await confirmed(call)
    rid = await call.reply_playing(LONG_REPLY)
    await call.tick(300)
    call.engines.asr.say("Wait, stop that.", partial="Wait")
    call.started()
    assert call.named("input_audio_buffer.speech_tentative", await call.read())
    # "Wait" interrupts on its own, as soon as a hypothesis holds it: the held speech_started goes out
    # after the tentative, then the voice's transcription, and the reply is cancelled as a barge-in.
    call.audio(300)
    judged = await call.read()
    names = [n for n, _ in judged]
    start = names.index("input_audio_buffer.speech_started")
    assert names.index("output_audio_buffer.cleared") > start
    assert call.named("conversation.item.input_audio_transcription.delta", judged)[0]["delta"] == "Wait"
    done = call.done(rid)
    assert (done["status"], done["status_reason"]) == ("cancelled", "turn_detected")
    tentative, started = call.named("input_audio_buffer.speech_tentative")[0], call.named(
        "input_audio_buffer.speech_started")[-1]
    assert started["item_id"] == tentative["item_id"] and started["audio_start_ms"] == tentative["audio_start_ms"]
    # The turn goes on as any other: its end, commit, transcript, and a response to it.
    call.engines.replies.add(*words("Okay, I will stop."))
    call.audio(300)
    call.stopped()
    await call.tick(100)
    (completed,) = call.named("conversation.item.input_audio_transcription.completed")[-1:]
    assert (completed["item_id"], completed["transcript"]) == (tentative["item_id"], "Wait, stop that.")
    assert call.named("input_audio_buffer.committed")[-1]["item_id"] == tentative["item_id"]
    answer = call.named("response.created")[-1]["response_id"]
    assert answer != rid and call.audio_ms(answer) > 0
    assert call.counted("rtmedia_interruptions_total", outcome="interrupted") == 1


async def test_no_reply_audio_goes_out_after_speech_tentative(call: Call):
    await confirmed(call)
    rid = await call.reply_playing(LONG_REPLY)
    await call.tick(300)
    call.started()
    assert call.named("input_audio_buffer.speech_tentative", await call.read())
    assert call.audio_ms(rid, await call.tick(400)) == 0


async def paused_turn(call: Call, said: str) -> None:
    """The user says `said` and pauses (the recogniser's early final is `said`); a reply is prepared."""
    call.engines.asr.say(said)
    call.started()
    call.audio(800)
    call.paused()
    await call.read()
    assert call.counted("rtmedia_preemptive_replies_total", outcome="started") == 1


async def test_a_reply_prepared_at_a_pause_is_committed_when_the_turn_ends_with_the_same_words(call: Call):
    call.engines.replies.add(*words("It is sunny in Paris."))
    await paused_turn(call, "What is the weather in Paris?")
    # Prepared: the responder was asked with the words so far; nothing of it reached the client.
    (request,) = call.engines.replies.requests
    assert (request.history[-1].role, request.history[-1].text) == ("user", "What is the weather in Paris?")
    assert not [n for n, _ in call.events if n.startswith("response.")]
    assert call.engines.tts.spoken == ["It is sunny"]  # its first clause only, synthesised ahead
    await call.tick(200)
    call.stopped()  # the transcript holds the same words: the prepared reply is this turn's response
    await call.tick(100)
    (created,) = call.named("response.created")
    rid = created["response_id"]
    assert call.named("response.output_text.done")[0]["text"] == "It is sunny in Paris."
    assert call.audio_ms(rid) == 1000
    assert call.done(rid)["timings"]["preemptive"] == "committed"
    assert len(call.engines.replies.requests) == 1  # the responder was not asked again
    assert call.counted("rtmedia_preemptive_replies_total", outcome="committed") == 1
    assert call.counted("rtmedia_preemptive_replies_total", outcome="discarded") == 0


async def test_a_reply_prepared_at_a_pause_is_discarded_unseen_when_speech_resumes(call: Call):
    call.engines.replies.add(*words("The weather where?"))  # the prepared reply, to "What is the weather"
    call.engines.replies.add(*words("It is sunny in Paris."))
    await paused_turn(call, "What is the weather")
    await call.tick(100)
    call.engines.asr.say("in Paris?")
    call.audio(400)  # speech resumed after the pause
    await call.read()
    assert call.counted("rtmedia_preemptive_replies_total", outcome="discarded") == 1
    # Its first clause had been synthesised: "The weather where?", 3 words.
    assert call.counted("rtmedia_preemptive_discarded_audio_seconds_total") == pytest.approx(3 * MS_PER_WORD / 1000)
    call.stopped()
    await call.tick(100)
    # The turn's one response is made afresh for the whole transcript; the prepared one never showed.
    (created,) = call.named("response.created")
    rid = created["response_id"]
    assert [f["text"] for f in call.named("response.output_text.done")] == ["It is sunny in Paris."]
    assert "The" not in [f["delta"] for f in call.named("response.output_text.delta")]
    assert call.done(rid)["timings"]["preemptive"] == "none"
    first, second = call.engines.replies.requests
    assert first.history[-1].text == "What is the weather"
    assert second.history[-1].text == "What is the weather in Paris?"
    assert call.counted("rtmedia_preemptive_replies_total", outcome="committed") == 0


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})}


async def tool_call(call: Call, **config: Any) -> tuple[str, str]:
    """A session with a tool; a turn whose reply says a few words and calls it. (The reply's
    response id, the call's id), once its response.done is out."""
    call.send("session.update", session={"tools": {"functions": [WEATHER]}, **config})
    call.engines.replies.add("Let me check. ", CallDelta(0, "get_weather", '{"city": '), CallDelta(0, "", '"Paris"}'))
    await call.turn("What is the weather in Paris?")
    assert call.named("session.updated") and not call.named("error")
    rid = call.named("response.created")[-1]["response_id"]
    done = call.done(rid)
    assert (done["status"], call.audio_ms(rid)) == ("completed", 600)  # its text is spoken, its call is not
    (function_call,) = done["function_calls"]
    assert (function_call["name"], function_call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    return rid, function_call["call_id"]


async def test_a_function_call_is_waited_for_with_a_filler_until_its_output_and_answer(call: Call):
    rid, call_id = await tool_call(call)
    # The session waits for the tool: nothing until tool_filler_ms (800 ms) has passed, then a filler.
    assert not call.named("response.created", await call.tick(790))
    (filler,) = call.named("response.created", await call.tick(20))
    assert filler["filler"] and filler["response_id"] != rid
    await call.tick(100)
    assert call.done(filler["response_id"])["status"] == "completed"
    assert call.named("response.output_text.done")[-1]["text"] == Limits().tool_fillers[0]
    # The client's output, then its response.create: the answer cuts the filler still playing.
    call.send("conversation.item.create", item={"type": "function_call_output", "call_id": call_id,
                                                "output": '{"sky": "sunny"}'})
    call.engines.replies.add(*words("It is sunny in Paris."))
    call.send("response.create")
    answered = await call.tick(100)
    assert call.named("conversation.item.added", answered)[0]["item"]["call_id"] == call_id
    (cleared,) = call.named("output_audio_buffer.cleared", answered)
    assert cleared["response_id"] == filler["response_id"]
    answer = call.named("response.created", answered)[0]["response_id"]
    assert call.audio_ms(answer) == 1000 and call.done(answer)["status"] == "completed"
    # The responder answered from the history with the call and its output, without the filler.
    history = call.engines.replies.requests[-1].history
    assert [(m.role, m.text) for m in history if m.call is None] == [
        ("user", "What is the weather in Paris?"), ("assistant", "Let me check."), ("tool", '{"sky": "sunny"}')]
    assert [m.call.name for m in history if m.call is not None] == ["get_weather"]
    # The wait is over: no apology comes.
    assert not call.named("response.created", await call.tick(15000))


async def test_a_function_call_unanswered_for_tool_timeout_ms_ends_with_the_apology(call: Call):
    _, call_id = await tool_call(call, tool_timeout_ms=2000, tool_filler_ms=0)
    assert not call.named("response.created", await call.tick(1990))  # no filler: it is off
    (apology,) = call.named("response.created", await call.tick(20))
    await call.tick(3000)  # its 14 words, paced at the playback
    done = call.done(apology["response_id"])
    assert (done["status"], done["status_reason"]) == ("completed", "tool_timeout")
    assert call.named("response.output_text.done")[-1]["text"] == Limits().tool_apology
    assert call.audio_ms(apology["response_id"]) == len(Limits().tool_apology.split()) * MS_PER_WORD
    # A late output is still taken.
    call.send("conversation.item.create", item={"type": "function_call_output", "call_id": call_id, "output": "{}"})
    assert call.named("conversation.item.added", await call.read()) and not call.named("error")
    await call.turn("Try again.")  # the apology joined the history, before the late output
    texts = [(m.role, m.text) for m in call.engines.replies.requests[-1].history if m.call is None]
    assert texts[-3:] == [("assistant", Limits().tool_apology), ("tool", "{}"), ("user", "Try again.")]


async def idle_session(call: Call) -> str:
    """idle_timeout_ms 5000, and a reply of 1.2 s playing (all of it sent): its response id."""
    call.send("session.update", session={"turn_detection": {"idle_timeout_ms": 5000}})
    rid = await call.reply_playing("Paris is lovely in the spring.")
    assert call.audio_ms(rid) == 1200 and call.done(rid)["status"] == "completed"
    return rid


async def test_an_idle_timeout_prompts_the_user_once_the_reply_has_played_and_the_quiet_lasted(call: Call):
    await idle_session(call)
    # The quiet begins when the reply's playback ends (1.2 s after its first audio, without acks).
    assert not call.named("input_audio_buffer.timeout_triggered", await call.tick(6190))
    got = await call.tick(20)
    (timeout,) = call.named("input_audio_buffer.timeout_triggered", got)
    (committed,) = call.named("input_audio_buffer.committed", got)
    assert (committed["item_id"], committed["audio_ms"]) == (timeout["item_id"], 0)
    # An empty user turn, answered: the responder prompts the user to go on.
    prompt = call.named("response.created", got)[0]["response_id"]
    await call.tick(100)
    assert call.done(prompt)["status"] == "completed" and len(call.engines.replies.requests) == 2
    # Each timeout restarts the count: the next comes only after another quiet 5 s.
    assert not call.named("input_audio_buffer.timeout_triggered", await call.tick(4900))
    assert call.named("input_audio_buffer.timeout_triggered", await call.tick(400))


async def test_speech_holds_the_idle_timer_and_an_ack_moves_the_end_of_playback(call: Call):
    rid = await idle_session(call)
    await call.tick(1000)
    call.send("playback.ack", response_id=rid, played_ms=200)  # the client is behind: 1 s left to play
    assert not call.named("input_audio_buffer.timeout_triggered", await call.tick(5900))
    assert call.named("input_audio_buffer.timeout_triggered", await call.tick(200))
    await call.tick(100)  # its prompt plays out (200 ms)
    call.started()  # the user speaks before the next timeout: none comes while they do
    assert not call.named("input_audio_buffer.timeout_triggered", await call.tick(20000))


async def test_an_idle_timeout_counts_from_where_a_truncate_stopped_the_playback(call: Call):
    rid = await idle_session(call)
    await call.tick(1000)
    item_id = call.named("response.created")[0]["item_id"]
    call.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=600)
    assert call.named("conversation.item.truncated", await call.read())
    assert not call.named("input_audio_buffer.timeout_triggered", await call.tick(4900))
    assert call.named("input_audio_buffer.timeout_triggered", await call.tick(200)), rid
