"""Log lines carry the structured fields in both formats (a session's token NAME, its peer,
...): JSON as keys of the object, text as key=value after the message."""

from __future__ import annotations

import json
import logging

from rtmedia.protocol.logs import JsonFormatter, TextFormatter


def record(msg: str = "peer closing", exc: bool = False, **fields: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            import sys
            exc_info = sys.exc_info()
    rec = logging.LogRecord("rtmedia.web", logging.INFO, __file__, 1, msg, None, exc_info)
    rec.__dict__.update(fields)
    return rec


def test_json_lines_hold_the_fields():
    entry = json.loads(JsonFormatter().format(record(peer="ab12cd34", token_name="alice")))
    assert (entry["msg"], entry["peer"], entry["token_name"]) == ("peer closing", "ab12cd34", "alice")


def test_text_lines_hold_the_fields_after_the_message():
    line = TextFormatter().format(record(peer="ab12cd34", token_name="alice", reason="the user left", n=3))
    assert line.endswith('rtmedia.web: peer closing peer=ab12cd34 token_name=alice reason="the user left" n=3'), line
    assert TextFormatter().format(record()).endswith("rtmedia.web: peer closing")
    # A traceback stays below the line that has the fields.
    first, *rest = TextFormatter().format(record(exc=True, peer="ab12cd34")).split("\n")
    assert first.endswith("peer=ab12cd34") and rest[0].startswith("Traceback") and "RuntimeError: boom" in rest[-1]
