"""What a reply leaves behind: Response.heard_text, played_ms and audible; and cancelling
a response in the reply pipeline (epoch, events, history)."""

from __future__ import annotations

import asyncio

import pytest
from rtmedia.engines.responder import Message
from rtmedia.protocol.events import to_json
from rtmedia.server.outbox import Outbox
from rtmedia.server.reply import ACK_FRESH_S, PLAYED_TOLERANCE_MS, ReplyPipeline, Response
from rtmedia.server.session_config import SessionSettings
from rtmedia.server.session_limits import Limits

CLAUSES = [("Hello there,", 0, 1000), ("how are you today?", 1000, 3000)]


def response(**fields) -> Response:
    return Response("resp_1", "item_1", 0, clauses=list(CLAUSES), sent_samples=3 * 24000, sent_ms=3000, **fields)


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


class _Metrics:
    pass


def pipeline(history: list[Message]) -> tuple[ReplyPipeline, Outbox]:
    outbox = Outbox(16)
    replies = ReplyPipeline(
        "sess_1", outbox, history, Limits(), tts=None, replies=None, metrics=_Metrics(),
        settings=SessionSettings, request=lambda *a, **k: None, spawn=lambda coro, name: None,
        new_id=lambda prefix: prefix, on_done=lambda: None,
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
    assert history[-1] == Message("assistant", "Hello there, how are")
    assert generating.history_index == 1


async def test_cancel_after_the_reply_was_generated_truncates_its_history():
    history = [Message("user", "hi"), Message("assistant", "Hello there, how are you today?")]
    replies, outbox = pipeline(history)
    replies.response = done = response(done=True, history_index=1, heard_ms=1000)
    replies.cancel("turn_detected")
    assert replies.epoch == 1
    assert history == [Message("user", "hi"), Message("assistant", "Hello there,")]
    assert (await next_event(outbox))["type"] == "output_audio_buffer.cleared"
    assert done.done
