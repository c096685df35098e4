"""The session outbox: control overtakes media, stale epochs are dropped, close, and the bound
in events and bytes."""

from __future__ import annotations

import asyncio

from rtmedia.protocol.events import server_event, to_json
from rtmedia.server.session.outbox import Outbox


def delta(text: str):
    return server_event("response.output_text.delta", response_id="r", item_id="i", delta=text)


def control(reason: str):
    return server_event("input_audio_buffer.cleared", discarded_ms=0, reason=reason)


async def get(outbox: Outbox, epoch: int):
    return await asyncio.wait_for(outbox.get(epoch), 1)


async def drain(outbox: Outbox, epoch: int) -> list:
    """Everything `get` returns until None (the outbox must be closed)."""
    out = []
    while (event := await asyncio.wait_for(outbox.get(epoch), 1)) is not None:
        out.append(event)
    return out


async def test_control_overtakes_queued_media():
    outbox = Outbox(16)
    first, second, urgent = delta("a"), delta("b"), control("client")
    outbox.media(0, first)
    outbox.media(0, second)
    outbox.control(urgent)
    assert await get(outbox, 0) is urgent
    assert await get(outbox, 0) is first
    outbox.control(later := control("later"))
    assert await get(outbox, 0) is later  # still ahead of the media queued before it
    assert await get(outbox, 0) is second


async def test_media_of_an_older_epoch_is_never_returned():
    outbox = Outbox(16)
    stale, current = delta("stale"), delta("current")
    outbox.media(0, stale)
    outbox.media(1, current)
    assert await get(outbox, 1) is current
    outbox.media(0, late := delta("late of a cancelled response"))
    outbox.media(1, fresh := delta("fresh"))
    outbox.close()
    assert await drain(outbox, 1) == [fresh]
    assert late is not fresh


async def test_a_fenced_responses_done_still_goes_out():
    """A response all generated when a barge-in came may have its response.done queued behind its
    audio: the rest of its media is dropped, its response.done is not."""
    outbox = Outbox(16)
    outbox.media(0, delta("queued audio"))
    outbox.media(0, done := server_event("response.done", response_id="r", status="completed"))
    outbox.close()
    assert await drain(outbox, 1) == [done]


async def test_close_sends_last_after_what_is_queued():
    outbox = Outbox(16)
    media, ctl = delta("a"), control("client")
    last = server_event("session.closed", reason="client")
    outbox.media(0, media)
    outbox.control(ctl)
    outbox.close(last)
    outbox.close(server_event("session.closed", reason="second close"))  # the first close's last stays
    assert outbox.closed
    assert await drain(outbox, 0) == [ctl, media, last]
    assert to_json(last)["reason"] == "client"
    assert await get(outbox, 0) is None  # and stays closed


async def test_get_waits_for_an_event():
    outbox = Outbox(16)
    waiting = asyncio.ensure_future(outbox.get(0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    outbox.media(1, delta("other epoch"))  # wakes it, but is dropped
    await asyncio.sleep(0.01)
    assert not waiting.done()
    outbox.media(0, event := delta("x"))
    assert await asyncio.wait_for(waiting, 1) is event


def error_of(event) -> str | None:
    return event.error.code if event.WhichOneof("event") == "error" else None


async def test_an_overflow_drops_the_event_says_so_and_recovers_once_read():
    failed = []
    outbox = Outbox(2, notify=lambda _: failed.append(True))
    outbox.media(0, delta("a"))
    outbox.control(control("client"))
    outbox.media(0, delta("dropped"))  # a third event does not fit
    assert outbox.queued[0] == 3 and outbox.overflowing and not failed
    events = [await get(outbox, 0) for _ in range(3)]
    assert [error_of(e) for e in events] == [None, "client_too_slow", None]
    assert "response.output_text.delta event was dropped" in events[1].error.message
    assert to_json(events[2])["delta"] == "a" and outbox.queued == (0, 0)
    assert not outbox.overflowing, "read down to half: the next overflow is a warning again"
    for text in "bcd":
        outbox.media(0, delta(text))
    assert not failed and outbox.overflowing


async def test_an_overflow_that_goes_on_fails_the_outbox_and_lets_go_of_it():
    failed = []
    outbox = Outbox(1000, max_bytes=4096, notify=lambda _: failed.append(True))
    big = "x" * 1500
    for _ in range(2):
        outbox.control(server_event("error", code="invalid_value", message="bad", event_id=big))
    outbox.control(server_event("error", code="invalid_value", message="bad", event_id=big))  # warned
    assert not failed and outbox.overflowing
    outbox.control(server_event("error", code="invalid_value", message="bad", event_id=big))  # goes on
    assert failed == [True] and outbox.failed and outbox.queued == (0, 0)
    outbox.media(0, delta("late"))
    outbox.control(control("client"))
    assert outbox.queued == (0, 0), "nothing more is kept for a client that does not read"
