"""Function calls in a local LM's streamed text (docs/protocol.md#tools), one parser per form:

- `HermesParser`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5 and
  Qwen3 (and Hermes) templates teach their models; text outside the tags is the reply's.
- `JsonParser`: Llama 3.1+'s JSON form: the reply is a call, `{"name": ..., "parameters":
  {...}}` (or "arguments"), optionally after `<|python_tag|>`, several separated by ";".

`parser_for(template)` picks the form from the chat template. A parser is fed the reply's text
deltas as they stream and returns what to pass on: text to speak (never the call itself) and
`CallDelta`s, one per call once its JSON is complete; a call whose JSON does not parse is a
`CallError` (the session reports it and the reply goes on without it).
"""

from __future__ import annotations

import json
from typing import Any

from rtmedia.engines.responders.contract import CallDelta, CallError

Output = str | CallDelta | CallError


def parser_for(template: str | None) -> type[HermesParser] | type[JsonParser] | None:
    """The parser of the tool-call form a chat template teaches, or None (no tools)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HermesParser
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return JsonParser
    return None


def _call(index: int, text: str, keys: tuple[str, ...]) -> CallDelta | CallError:
    """The call in `text` (its JSON), or why it is not one."""
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return CallError(f"a function call is not valid JSON ({str(exc)[:80]}): {text[:120]!r}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return CallError(f"a function call has no name: {text[:120]!r}")
    arguments = next((data[k] for k in keys if k in data), {})
    if isinstance(arguments, str):  # some models quote the arguments' JSON
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return CallError(f"the arguments of {data['name']!r} are not JSON: {arguments[:120]!r}")
    if not isinstance(arguments, dict):
        return CallError(f"the arguments of {data['name']!r} are not an object: {str(arguments)[:120]!r}")
    return CallDelta(index, data["name"], json.dumps(arguments))


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""  # text not yet passed on: a call's body, or what may begin a tag
        self._in_call = False
        self._calls = 0

    def feed(self, delta: str) -> list[Output]:
        self._buffer += delta
        out: list[Output] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return out
                out.append(_call(self._calls, self._buffer[:end].strip(), ("arguments", "parameters")))
                self._calls += isinstance(out[-1], CallDelta)
                self._buffer, self._in_call = self._buffer[end + len(self.CLOSE):], False
                continue
            start = self._buffer.find(self.OPEN)
            if start >= 0:
                if start:
                    out.append(self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(self.OPEN):], True
                continue
            keep = _partial_suffix(self._buffer, self.OPEN)  # "<tool" may be a tag's start
            if len(self._buffer) > keep:
                out.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
            return out

    def flush(self) -> list[Output]:
        """The reply ended: what is left (a call never closed is read as it stands)."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            return [_call(self._calls, rest.strip(), ("arguments", "parameters"))] if rest.strip() else []
        return [rest] if rest else []


class JsonParser:
    """A reply that opens with "{" (after any whitespace and `<|python_tag|>`) is calls; any
    other reply is text, passed on as it streams."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._head = ""  # the reply's start, until it is known to be text or calls
        self._mode: str | None = None  # "text" or "calls"

    def feed(self, delta: str) -> list[Output]:
        if self._mode == "text":
            return [delta] if delta else []
        self._head += delta
        if self._mode == "calls":
            return []
        head = self._head.lstrip()
        if head.startswith(self.TAG) or (head and head[0] == "{"):
            self._mode = "calls"
            return []
        if not head or self.TAG.startswith(head):
            return []
        self._mode, text = "text", self._head
        self._head = ""
        return [text]

    def flush(self) -> list[Output]:
        if self._mode != "calls":
            text, self._head = self._head, ""
            return [text] if text.strip() else []
        body = self._head.lstrip().removeprefix(self.TAG).strip()
        self._head = ""
        out: list[Output] = []
        for part in _json_objects(body):
            out.append(_call(sum(isinstance(o, CallDelta) for o in out), part, ("parameters", "arguments")))
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_objects(body: str) -> list[str]:
    """`body` split into its top-level JSON objects (separated by ";" or whitespace); a part
    that is not an object is returned as it is (and fails to parse)."""
    parts, depth, start, quoted, escaped = [], 0, None, False, False
    for i, ch in enumerate(body):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0 and start is not None:
                parts.append(body[start:i + 1])
                start = None
        elif depth == 0 and not ch.isspace() and ch != ";":
            return [*parts, body[i:]]
    if depth and start is not None:
        parts.append(body[start:])
    return parts
