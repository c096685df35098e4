"""The request strategies of the fuzzing (tests/reliability/strategies.py), without a server.

Synchronous, and so kept out of test_fuzz.py: a synchronous test there would pause the event
loop its server and well-behaved session share, and the session's microphone, catching up
afterwards, would overflow its own input inbox."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from rtmedia.v1 import realtime_pb2, speech_pb2, video_pb2

from tests.reliability.strategies import message
from tests.reliability.test_fuzz import FUZZ


@pytest.mark.parametrize("cls", [realtime_pb2.ConverseRequest, speech_pb2.TranscribeRequest,
                                 speech_pb2.SynthesizeRequest, video_pb2.DecodeVideoRequest])
def test_generic_messages_set_every_field(cls):
    """`strategies.message` sets every field of a request (every oneof member included), so a field
    added to a request later is fuzzed without a change."""
    seen: set[str] = set()

    @settings(max_examples=300, **FUZZ)
    @given(msg=message(cls))
    def collect(msg):
        seen.update(f.name for f, _ in msg.ListFields())

    collect()
    assert seen == set(cls.DESCRIPTOR.fields_by_name), set(cls.DESCRIPTOR.fields_by_name) - seen
