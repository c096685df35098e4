"""What a reply leaves behind: Response.heard_text, played_ms, audible and playback_end; cancelling
a response in the reply pipeline (epoch, events, history); text-only, out-of-band and
token-limited (incomplete) replies."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from rtmedia.engines.responders.contract import (
    CallDelta,
    CallError,
    FunctionCall,
    Incomplete,
    Message,
    ReplyRequest,
)
from rtmedia.protocol.events import to_json
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.session.config import SessionSettings
from rtmedia.server.session.limits import Limits
from rtmedia.server.session.outbox import Outbox
from rtmedia.server.session.reply import ACK_FRESH_S, PLAYED_TOLERANCE_MS, ReplyPipeline, Response

CLAUSES = [("Hello there,", 0, 1000), ("how are you today?", 1000, 3000)]


def response(**fields) -> Response:
    return Response("resp_1", "item_1", 0, clauses=list(CLAUSES), sent_samples=3 * 24000, sent_ms=3000, **fields)


async def test_timings_are_the_time_each_stage_added_and_sum_to_at_most_voice_to_voice():
    from rtmedia.server.hearing.recognition import Turn

    turn = Turn("item_0", stopped_at=10.5)
    turn.speech_end_at = 10.0
    # A prepared reply: its first text and audio came before the turn ended.
    r = Response("r", "i", 0, turn=turn, transcript_at=10.52, first_text_at=10.3, first_audio_ready_at=10.4,
                 first_audio_at=10.53, preemptive="committed")
    assert r.timings() == {"turn_detection_ms": 500, "transcription_ms": 20, "first_text_ms": 0, "first_audio_ms": 0,
                           "voice_to_voice_ms": 530, "preemptive": "committed"}
    # Cancelled before its first text: the later stages are absent.
    r = Response("r", "i", 0, turn=turn, transcript_at=10.6)
    assert r.timings() == {"turn_detection_ms": 500, "transcription_ms": 100, "preemptive": "none"}
    # No turn (response.create on text): from its creation.
    r = Response("r", "i", 0, created_at=5.0, first_text_at=5.2, first_audio_ready_at=5.5, first_audio_at=5.51)
    t = r.timings()
    assert (t["turn_detection_ms"], t["transcription_ms"], t["first_text_ms"], t["first_audio_ms"]) == (0, 0, 200, 300)
    assert sum(t[k] for k in t if k not in ("preemptive", "voice_to_voice_ms")) <= t["voice_to_voice_ms"] == 510


def test_a_replys_leading_silence_is_trimmed_to_ten_ms():
    import numpy as np
    from rtmedia.server.session.reply import trim_lead

    rate = 22050
    pcm = np.concatenate([np.zeros(rate // 20, "<i2"), np.full(100, 3000, "<i2")]).tobytes()  # 50 ms quiet
    assert len(trim_lead(pcm, rate)) == 2 * (rate // 100 + 100)
    assert trim_lead(bytes(400), rate) == bytes(400)  # no sound: kept whole


def test_heard_text_without_acks_is_what_was_sent():
    assert response().heard_text() == "Hello there, how are you today?"
    assert Response("r", "i", 0).heard_text() == ""


@pytest.mark.parametrize("heard_ms,text", [
    (0, ""),
    (400, ""),  # under half of a two-word clause: not one word yet
    (500, "Hello"),  # half of it: one word
    (999, "Hello"),  # cut at a word boundary, rounding down
    (1000, "Hello there,"),  # whole clauses
    (1499, "Hello there,"),  # a quarter of four words is one word: not yet
    (1500, "Hello there, how"),
    (2000, "Hello there, how are"),  # half of the current clause
    (2999, "Hello there, how are you"),
    (3000, "Hello there, how are you today?"),
    (9999, "Hello there, how are you today?"),  # at most what was sent
])
def test_heard_text_is_whole_clauses_then_the_played_fraction(heard_ms, text):
    assert response(heard_ms=heard_ms).heard_text() == text


def test_played_ms_follows_a_fresh_ack_and_the_clock_after_a_stale_one():
    now = 1000.0
    fresh = response(heard_ms=500, heard_at=now - ACK_FRESH_S / 2, first_audio_at=now - 2.0)
    assert fresh.played_ms(now) == 500  # the ack, not the 2 s of wall clock
    stale = response(heard_ms=500, heard_at=now - ACK_FRESH_S - 0.1, first_audio_at=now - 1.2)
    assert stale.played_ms(now) == 1200  # the wall clock since the first audio
    truncated = response(heard_ms=500, heard_at=now - 10, truncated=True, first_audio_at=now - 2.0)
    assert truncated.played_ms(now) == 500  # a truncate says where playback stopped, for good
    assert response(heard_ms=9000, heard_at=now).played_ms(now) == 3000  # at most what was sent
    assert response(first_audio_at=now - 60).played_ms(now) == 3000
    assert response().played_ms(now) == 0  # no audio sent yet, no ack


def test_audible_while_generating_or_playing():
    now = 1000.0
    assert response(first_audio_at=now - 60).audible(now)  # not done: generating
    playing = response(done=True, first_audio_at=now - 1.0)
    assert playing.audible(now)  # 1000 of 3000 ms played
    before = response(done=True, first_audio_at=now - (3000 - PLAYED_TOLERANCE_MS - 20) / 1000)
    assert before.audible(now)
    almost = response(done=True, first_audio_at=now - (3000 - PLAYED_TOLERANCE_MS + 20) / 1000)
    assert not almost.audible(now)  # within the rounding tolerance of the end
    assert not response(done=True, heard_ms=100, heard_at=now, truncated=True).audible(now)


def pipeline(history: list[Message]) -> tuple[ReplyPipeline, Outbox]:
    outbox = Outbox(16)
    replies = ReplyPipeline(
        "sess_1", outbox, history, Limits(), tts=None, replies=None, metrics=Metrics(),
        settings=SessionSettings, request=lambda *a, **k: None, spawn=lambda coro, name: None,
        new_id=lambda prefix: prefix, notify=lambda done: None,
    )
    return replies, outbox


async def next_event(outbox: Outbox) -> dict:
    return to_json(await asyncio.wait_for(outbox.get(1), 1))


async def test_cancel_fences_the_epoch_and_keeps_what_was_heard():
    history = [Message("user", "hi")]
    replies, outbox = pipeline(history)
    replies.response = generating = response(heard_ms=2000)
    replies.cancel("turn_detected")
    assert replies.epoch == 1 and generating.done
    outbox.close()
    events = [await next_event(outbox), await next_event(outbox)]
    assert [e["type"] for e in events] == ["output_audio_buffer.cleared", "response.done"]
    assert events[0]["audio_end_ms"] == 3000
    assert events[1]["status"] == "cancelled" and events[1]["status_reason"] == "turn_detected"
    assert history[-1] == Message("assistant", "Hello there, how are", "item_1")


async def test_cancel_after_the_reply_was_generated_truncates_its_history():
    history = [Message("user", "hi", "item_0"), Message("assistant", "Hello there, how are you today?", "item_1")]
    replies, outbox = pipeline(history)
    replies.response = done = response(done=True, heard_ms=1000)
    replies.cancel("turn_detected")
    assert replies.epoch == 1
    assert history == [Message("user", "hi", "item_0"), Message("assistant", "Hello there,", "item_1")]
    assert (await next_event(outbox))["type"] == "output_audio_buffer.cleared"
    assert done.done


def test_a_text_only_reply_was_heard_as_far_as_it_was_sent():
    text_only = Response("r", "i", 0, text_only=True, text="Hello  there, how")
    assert text_only.heard_text() == "Hello there, how"


def test_playback_end_follows_acks_truncation_clearing_and_the_clock():
    sent = {"first_audio_at": 100.0, "done_at": 101.0}
    assert response(**sent).playback_end() == 103.0  # 3 s of audio from the first delta
    assert response(**sent, heard_ms=1000, heard_at=102.5).playback_end() == 104.5  # 2 s left after the ack
    assert response(**sent, heard_ms=1000, heard_at=101.5, truncated=True).playback_end() == 101.5
    assert response(**sent, cleared_at=101.2).playback_end() == 101.2
    assert Response("r", "i", 0, done_at=50.0).playback_end() == 50.0  # no audio: when it ended
    assert response(first_audio_at=100.0, done_at=104.0).playback_end() == 104.0  # never before it ended


async def test_cancelling_a_text_only_or_out_of_band_reply():
    history = [Message("user", "hi", "item_0")]
    replies, outbox = pipeline(history)
    replies.response = Response("resp_1", "item_1", 0, text_only=True, text="Sure, here")
    replies.cancel("client_cancelled")
    assert (await next_event(outbox))["type"] == "response.done", "no audio to clear"
    assert history[-1] == Message("assistant", "Sure, here", "item_1")
    replies.response = Response("resp_2", "item_2", 1, text_only=True, text="Aside", joins_history=False)
    replies.cancel("client_cancelled")
    assert history[-1].item_id == "item_1", "an out-of-band reply never joins the history"


class _Replies:
    """A responder lane that streams `deltas`."""

    def __init__(self, deltas: list) -> None:
        self.deltas = deltas

    async def reply(self, name: str, request: ReplyRequest):
        for delta in self.deltas:
            yield delta

    def pause(self, *args) -> None:
        pass

    def resume(self, *args) -> None:
        pass


async def run_reply(deltas: list, **start) -> tuple[list[dict], list[Message]]:
    """One text-only reply (no TTS) through the pipeline: its events and the history after it."""
    history = [Message("user", "hi", "item_0")]
    outbox = Outbox(64)
    tasks: list[asyncio.Task] = []
    ids = itertools.count(1)
    replies = ReplyPipeline(
        "sess_1", outbox, history, Limits(), tts=None, replies=_Replies(deltas), metrics=Metrics(),
        settings=lambda: SessionSettings(output_modality="text"), request=lambda *a, **k: ReplyRequest(history),
        spawn=lambda coro, name: tasks.append(asyncio.ensure_future(coro)) or tasks[-1],
        new_id=lambda prefix: f"{prefix}_{next(ids)}", notify=lambda done: outbox.close(),
    )
    replies.start(None, **start)
    await asyncio.gather(*tasks)
    events = []
    while (event := await asyncio.wait_for(outbox.get(0), 1)) is not None:
        events.append(to_json(event))
    return events, history


async def test_a_reply_the_token_limit_stopped_is_incomplete_with_its_done_events():
    events, history = await run_reply(["Hello ", "there", Incomplete()])
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.done"], "text only: no audio events"
    assert events[-2]["text"] == "Hello there"
    assert (events[-1]["status"], events[-1]["status_reason"]) == ("incomplete", "max_output_tokens")
    assert history[-1] == Message("assistant", "Hello there", events[0]["item_id"])


async def test_an_out_of_band_reply_leaves_the_history_as_it_was():
    events, history = await run_reply(["Aside."], joins_history=False)
    assert events[-1]["status"] == "completed" and events[-2]["text"] == "Aside."
    assert history == [Message("user", "hi", "item_0")]


async def test_a_reply_that_calls_functions_streams_each_call_after_its_message():
    events, history = await run_reply(["Let me look. ", CallDelta(0, "get_weather", '{"city": '),
                                       CallDelta(1, "get_time", ""), CallDelta(0, "", '"Paris"}'),
                                       CallDelta(1, "", "{}")])
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.output_text.delta", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.output_text.done",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done", "response.done"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(a["output_index"], a["item"]["name"], a["item"]["arguments"]) for a in added] == \
        [(1, "get_weather", ""), (2, "get_time", "")]
    done = events[-1]
    assert done["status"] == "completed"
    calls = done["function_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert len({c["call_id"] for c in calls}) == 2 and all(c["call_id"].startswith("call_") for c in calls)
    assert events[-2]["item"] == calls[1]
    message = events[0]["item_id"]
    assert history[1:] == [Message("assistant", "Let me look.", message),
                           Message("assistant", "", calls[0]["id"], call=FunctionCall(calls[0]["call_id"],
                                                                                      "get_weather", '{"city": "Paris"}')),
                           Message("assistant", "", calls[1]["id"], call=FunctionCall(calls[1]["call_id"],
                                                                                      "get_time", "{}"))]


async def test_a_malformed_call_is_an_error_event_and_the_reply_goes_on():
    events, history = await run_reply(["Sure. ", CallError("a function call is not valid JSON"), "Done."])
    errors = [e for e in events if e["type"] == "error"]
    assert errors[0]["code"] == "invalid_function_call" and "not valid JSON" in errors[0]["message"]
    assert events[-1]["status"] == "completed" and not events[-1].get("function_calls")
    assert history[-1].text == "Sure. Done."


async def test_a_call_without_a_name_fails_the_response():
    events, _ = await run_reply([CallDelta(0, "", "{}")])
    assert events[-1]["status"] == "failed" and "without a name" in events[-1]["status_reason"]


async def test_the_servers_own_words_are_spoken_instead_of_the_responders():
    events, history = await run_reply(["never used"], say="One moment.", filler=True, joins_history=False)
    assert events[0]["filler"] is True
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["One ", "moment."]
    assert len(history) == 1
    events, history = await run_reply([], say="Sorry.", reason="tool_timeout")
    assert (events[-1]["status"], events[-1]["status_reason"]) == ("completed", "tool_timeout")
    assert history[-1].text == "Sorry."
