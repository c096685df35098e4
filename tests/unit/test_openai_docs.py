"""docs/openai.md's Realtime session fields against the front's parser (web/openai/realtime_config.py).

The "Session fields" table names each field of `session.update` and says how the front takes it:
`served`, `mapped` or `extension` (accepted, and the session changes), `accepted` (checked, the
session stays as it was), `refused` (`unsupported_parameter` naming the field; the third column
then says, in backquotes, which values are still accepted), `unknown_parameter` (any other field).
Each field is sent in a session.update with a value a client would send to use it, and the
parser must answer as the table says; a field the table lists without a probe here, or one the
front's session object carries that the table leaves out, fails too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from rtmedia.web.openai.realtime_config import INCLUDE_LOGPROBS, RealtimeConfig, RealtimeError, new_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
TAKEN = {"served", "mapped", "extension"}  # accepted, and the session changes

# A value a client sends to use each field (a non-default one, so that a served field shows).
PROBES: dict[str, Any] = {
    "type": "realtime",
    "model": "gpt-realtime",
    "instructions": "Answer in one sentence.",
    "output_modalities": ["text"],
    "max_output_tokens": 200,
    "audio.input.format": {"type": "audio/pcmu"},
    "audio.input.transcription": {"model": "whisper-1", "language": "en"},
    "audio.input.turn_detection": {"type": "semantic_vad", "eagerness": "high"},
    "audio.input.turn_detection.interruption": {"mode": "confirmed", "min_words": 2},
    "audio.input.noise_reduction": {"type": "near_field"},
    "audio.output.format": {"type": "audio/pcma"},
    "audio.output.voice": "echo",
    "audio.output.speed": 1.25,
    "tools": [{"type": "function", "name": "get_time", "description": "The time now",
               "parameters": {"type": "object", "properties": {}}}],
    "tool_choice": "required",
    "tool_filler_ms": 1500,
    "tool_timeout_ms": 5000,
    "recording": True,
    "include": [INCLUDE_LOGPROBS],
    "prompt": {"id": "pmpt_123"},
    "tracing": "auto",
    "reasoning": {"effort": "low"},
    "truncation": "disabled",
    "parallel_tool_calls": False,
    "audio.input.transcription.prompt": "rtmedia, Piper, Whisper",
    "audio.input.transcription.delay": "low",
    "audio.input.transcription.keywords": ["rtmedia"],
    "audio.input.transcription.languages": ["en", "fr"],
}
# `type` cannot change within a session, so its probe is the session's own type.
UNCHANGED = {"type"}
# The session object's fields that a client reads and does not set.
READ_ONLY = {"object", "id", "expires_at"}


def session_rows() -> list[tuple[list[str], str, str]]:
    """(fields, how the front takes them, the notes) of each row of the Realtime API's "Session
    fields" table; `.name` after a field stands for the name beside it (`a.b`, `.c` -> `a.c`)."""
    text = DOC.read_text()
    section = text[text.index("# Realtime API"):]
    section = section[section.index("## Session fields"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or cells[0] in ("field", "---"):
            continue
        names: list[str] = []
        for name in re.findall(r"`([^`]+)`", cells[0]):
            names.append(names[-1].rsplit(".", 1)[0] + name if name.startswith(".") else name)
        rows.append((names, cells[1].strip("`"), " | ".join(cells[2:])))
    return rows


def nested(path: str, value: Any) -> dict[str, Any]:
    """A session.update's `session` that sets `path` (dotted) to `value`."""
    session: dict[str, Any] = {}
    *parents, last = path.split(".")
    at = session
    for part in parents:
        at = at.setdefault(part, {})
    at[last] = value
    return session


def update(session: dict[str, Any]) -> tuple[RealtimeConfig, RealtimeConfig]:
    """(before, after) a session.update of a fresh Realtime session; RealtimeError if refused."""
    before = new_config()
    return before, before.updated(session)


def listed() -> list[tuple[str, str, str]]:
    return [(name, how, notes) for names, how, notes in session_rows() for name in names]


def test_the_table_is_read():
    fields = [name for name, _, _ in listed()]
    assert len(fields) > 20 and len(set(fields)) == len(fields), fields
    assert {how for _, how, _ in listed()} <= TAKEN | {"accepted", "refused"}
    assert ([], "unknown_parameter") in [(names, how) for names, how, _ in session_rows()]


def test_every_listed_field_has_a_probe():
    assert sorted(name for name, _, _ in listed()) == sorted(PROBES)


@pytest.mark.parametrize("name, how, notes", listed(), ids=[name for name, _, _ in listed()])
def test_the_parser_takes_each_field_as_the_doc_says(name, how, notes):
    session = nested(name, PROBES[name])
    if how == "refused":
        with pytest.raises(RealtimeError) as refusal:
            update(session)
        assert (refusal.value.code, refusal.value.param) == ("unsupported_parameter", f"session.{name}")
        return
    try:
        before, after = update(session)
    except RealtimeError as exc:
        pytest.fail(f"docs/openai.md says {name} is {how}; the parser answers {exc.code}: {exc.message}")
    if how in TAKEN and name not in UNCHANGED:
        assert after != before, f"docs/openai.md says {name} is {how}; the session stays as it was"
    if how == "accepted":
        assert after == before, f"docs/openai.md says {name} is only accepted; the session changes"


def still_accepted(notes: str) -> list[Any]:
    """The values a refused field's notes say are accepted (`null`, `auto`, `""`, `[]`)."""
    values = []
    for word in re.findall(r"`([^`]*)`", notes):
        try:
            values.append(json.loads(word))
        except json.JSONDecodeError:
            values.append(word)
    return values


@pytest.mark.parametrize("name, notes", [(name, notes) for name, how, notes in listed() if how == "refused"],
                         ids=[name for name, how, _ in listed() if how == "refused"])
def test_a_refused_field_accepts_what_the_doc_says(name, notes):
    values = still_accepted(notes)
    assert values, f"docs/openai.md names no value of the refused {name} that is accepted"
    for value in values:
        try:
            update(nested(name, value))
        except RealtimeError as exc:
            pytest.fail(f"docs/openai.md says {name} {value!r} is accepted; the parser answers {exc.code}")


def test_any_other_field_is_an_unknown_parameter():
    with pytest.raises(RealtimeError) as refusal:
        update({"voice_cloning": True})
    assert (refusal.value.code, refusal.value.param) == ("unknown_parameter", "session.voice_cloning")


def paths(obj: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted paths of `obj`'s fields, a nested object's fields instead of the object where
    the table lists them one by one (audio, audio.input, audio.output)."""
    out = set()
    for key, value in obj.items():
        path = prefix + key
        if path in ("audio", "audio.input", "audio.output"):
            out |= paths(value, path + ".")
        else:
            out.add(path)
    return out


def test_the_table_lists_every_field_of_the_session_object():
    shown = paths(new_config().session_object()) - READ_ONLY
    assert shown - {name for name, _, _ in listed()} == set()
