"""The playback acknowledgement rule (rtmedia.protocol.playback): an ack every ACK_EVERY_MS of
played audio, and a last one once a reply is over if anything played since the last ack."""

from __future__ import annotations

from rtmedia.protocol.playback import ACK_EVERY_MS, PlaybackAck


def test_the_first_ack_comes_after_ack_every_ms_of_play():
    assert ACK_EVERY_MS == 200
    ack = PlaybackAck()
    assert ack.acked_ms == 0
    assert [ack.due(ms, False) for ms in (0, 20, 100, 199)] == [None] * 4
    assert ack.acked_ms == 0
    assert ack.due(200, False) == 200
    assert ack.acked_ms == 200


def test_none_is_due_between_steps_and_the_next_counts_from_the_last_ack():
    ack = PlaybackAck()
    assert ack.due(230, False) == 230  # a late tick acks what has played, not a multiple of 200
    assert [ack.due(ms, False) for ms in (240, 300, 429)] == [None] * 3
    assert ack.due(430, False) == 430
    assert ack.due(1000, False) == 1000  # a long gap: one ack for all of it
    assert ack.acked_ms == 1000


def test_a_reply_that_is_over_gets_a_final_ack_once():
    ack = PlaybackAck()
    assert ack.due(200, False) == 200
    assert ack.due(250, True) == 250  # under ACK_EVERY_MS since the last ack, but the reply is over
    assert ack.acked_ms == 250
    assert ack.due(250, True) is None  # never twice
    assert ack.due(250, True) is None


def test_nothing_new_played_means_no_ack_even_when_over():
    ack = PlaybackAck()
    assert ack.due(0, True) is None  # over before any audio played
    assert ack.acked_ms == 0
    assert ack.due(400, False) == 400
    assert ack.due(400, True) is None  # the last ack already reached the end
    assert ack.due(390, True) is None  # a position behind the last ack
    assert ack.acked_ms == 400


def test_a_reply_cut_short_is_acked_where_it_stopped():
    ack = PlaybackAck()
    assert ack.due(60, True) == 60  # cut after 60 ms: still acknowledged
    assert ack.due(60, True) is None
    assert ack.due(300, True) == 300  # more came out after all (the speaker's tail)
    assert ack.acked_ms == 300


def test_each_reply_keeps_its_own_position():
    first, second = PlaybackAck(), PlaybackAck()
    assert first.due(200, False) == 200
    assert second.due(100, False) is None
    assert (first.acked_ms, second.acked_ms) == (200, 0)
