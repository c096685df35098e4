"""Function calls in a local LM's streamed text (rtmedia.engines.responders.tool_parsers): each form's
parser on calls split across many tokens, text around calls, several calls, and malformed
JSON; the form is picked from the chat template."""

from __future__ import annotations

import json

import pytest
from rtmedia.engines.responders.contract import CallDelta, CallError
from rtmedia.engines.responders.tool_parsers import HermesParser, JsonParser, parser_for


def run(parser, text: str, piece: int) -> list:
    """`text` fed `piece` characters at a time (a token is a few characters), then flushed;
    adjacent text joined."""
    out: list = []
    for start in range(0, len(text), piece):
        out += parser.feed(text[start:start + piece])
    out += parser.flush()
    joined: list = []
    for item in out:
        if isinstance(item, str) and joined and isinstance(joined[-1], str):
            joined[-1] += item
        else:
            joined.append(item)
    return joined


HERMES = ('Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_calls_split_across_tokens(piece):
    assert run(HermesParser(), HERMES, piece) == [
        "Let me look that up. ", CallDelta(0, "get_weather", json.dumps({"city": "Paris"})),
        CallDelta(1, "get_time", "{}")]


def test_hermes_text_after_a_call_and_a_lone_angle_bracket_are_text():
    assert run(HermesParser(), 'a < b <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> done <tool', 3) == [
        "a < b ", CallDelta(0, "f", '{"x": 1}'), " done <tool"]


def test_hermes_malformed_and_nameless_calls_are_errors_and_the_text_goes_on():
    out = run(HermesParser(), 'Hi <tool_call>{"name": "f", "arguments": {</tool_call> and <tool_call>{"arguments": {}}'
                              '</tool_call> then <tool_call>{"name": "g", "arguments": {}}</tool_call>', 4)
    assert out[0] == "Hi " and out[2] == " and " and out[4] == " then "
    assert isinstance(out[1], CallError) and "not valid JSON" in out[1].message
    assert isinstance(out[3], CallError) and "no name" in out[3].message
    assert out[5] == CallDelta(0, "g", "{}"), "a call's index counts the calls that parsed"


def test_hermes_a_call_never_closed_is_read_at_the_end():
    assert run(HermesParser(), 'OK <tool_call>{"name": "f", "arguments": {"q": "x"}}', 5) == [
        "OK ", CallDelta(0, "f", '{"q": "x"}')]


def test_quoted_arguments_are_decoded():
    assert run(HermesParser(), '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', 6) == [
        CallDelta(0, "f", '{"a": 2}')]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_llama_json_calls_split_across_tokens(piece):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa}ris \\"x\\""}}; {"name": "g", ' \
           '"parameters": {}}'
    assert run(JsonParser(), text, piece) == [CallDelta(0, "get_weather", json.dumps({"city": 'Pa}ris "x"'})),
                                              CallDelta(1, "g", "{}")]


def test_llama_json_a_text_reply_streams_as_it_comes():
    parser = JsonParser()
    assert parser.feed("  ") == [] and parser.feed("The") == ["  The"] and parser.feed(" weather") == [" weather"]
    assert parser.flush() == []


def test_llama_json_malformed():
    [error] = run(JsonParser(), '{"name": "f", "parameters": {"a": }', 3)
    assert isinstance(error, CallError)


def test_the_form_is_picked_from_the_template():
    assert parser_for("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") is HermesParser
    assert parser_for('{% if tools %}<|python_tag|>{"name": ..., "parameters": ...}{% endif %}') is JsonParser
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert parser_for(None) is None
