"""Responders: the "brain" that turns a conversation into reply text.

A responder streams text deltas for one reply; the session speaks them chunk
by chunk (docs/protocol.md#streaming-tts) as they arrive, so audio starts before the text is
complete. Responders hold no per-session state: the session passes its
conversation (already truncated to what the user heard) with each request.

A reply stream ends at the reply's natural end, or with an `Incomplete` when the token limit
(`max_output_tokens`) stopped it: the session then reports the response as incomplete.

A responder that can call functions (`calls_tools`) gets the session's tools with each
request and streams its calls as `CallDelta`s beside the text it speaks; the client runs the
functions and their outputs come back in the history (docs/protocol.md#tools).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

# The tool message of a call whose output has not come.
NO_RESULT = "(no result: the function has not answered)"


@dataclass(frozen=True)
class FunctionTool:
    """A function the responder may call (the client runs it): its name, what it does, and
    its arguments' JSON Schema (an object schema)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class FunctionCall:
    """A call a reply made: the session's id for it, the function, its arguments (JSON text)."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One conversation item: a turn's words (role "user" or "assistant"), a function call the
    assistant made (role "assistant", `call` set, no text), or a function's output (role "tool":
    `call_id` and the output as `text`)."""

    role: str
    text: str
    # The conversation item it is (the session's id for it: conversation.item.delete and
    # .retrieve name it); responders ignore it.
    item_id: str = ""
    call: FunctionCall | None = None
    call_id: str = ""  # role "tool": the call this output answers


@dataclass
class ReplyRequest:
    history: list[Message]
    instructions: str = ""
    max_output_tokens: int = 0  # 0: the responder's own limit
    images: list[bytes] = field(default_factory=list)  # camera frames, oldest first
    # The conversation (session id) the reply belongs to: an LM responder keeps its
    # KV cache between the conversation's turns.
    conversation: Hashable | None = None
    # The functions the reply may call, and whether it must: "auto", "none", "required", or
    # a function's name.
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"
    # HTTP headers a responder that calls a server sends with the request (the W3C `traceparent`
    # of the server's responder span, so the upstream's trace continues the session's).
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CallDelta:
    """Yielded by a reply stream that calls a function: the `index`-th call of the reply
    (0, 1, ...) goes on. Its first delta names the function; `arguments` is the next piece of
    its JSON arguments (append-only)."""

    index: int
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Waiting:
    """Yielded by a reply stream before its text when the reply waits for a shared resource
    (an LM slot): `position` replies are ahead of it. The session tells its client."""

    position: int


@dataclass(frozen=True)
class Incomplete:
    """Yielded last by a reply stream that the token limit (`max_output_tokens`, or the
    responder's own cap) stopped before its natural end."""

    reason: str = "max_output_tokens"


class Responder(Protocol):
    """Optionally also `async prepare(request)` (get ready for the reply to `request.history`
    plus a user turn not yet transcribed) and `forget(conversation)` (the conversation ended)."""

    name: str

    def reply(self, request: ReplyRequest) -> AsyncIterator[str | Waiting | Incomplete | CallDelta | CallError]:
        """Stream the reply's text deltas (and `Waiting` while it waits its turn; `CallDelta`s of
        the functions it calls; `Incomplete` last when the token limit stopped it)."""
        ...


@dataclass(frozen=True)
class CallError:
    """Yielded by a reply stream in place of a function call that could not be read (a local
    LM's malformed call); `message` says why. The reply goes on without the call."""

    message: str


def chat_messages(history: list[Message]) -> list[dict[str, Any]]:
    """The history as chat-completions messages: a reply's text and the function calls after it
    are one assistant message, followed by a tool message per call, as chat APIs and templates
    require: its output wherever it lies in the history, else NO_RESULT (the user spoke on, or
    it timed out). Outputs are not repeated where they lie, nor sent without their call."""
    outputs = {m.call_id: m.text for m in history if m.role == "tool"}
    out: list[dict[str, Any]] = []
    for n, message in enumerate(history):
        if message.role == "tool":
            continue
        if message.call is None:
            out.append({"role": message.role, "content": message.text})
            continue
        call = {"id": message.call.call_id, "type": "function",
                "function": {"name": message.call.name, "arguments": message.call.arguments}}
        previous = history[n - 1] if n else None
        if previous is not None and previous.role == "assistant" and out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)  # after its reply's text, or a call before it
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        following = history[n + 1] if n + 1 < len(history) else None
        if following is None or following.call is None:  # the last call of the message: its outputs follow
            for c in out[-1]["tool_calls"]:
                out.append({"role": "tool", "tool_call_id": c["id"], "content": outputs.get(c["id"], NO_RESULT)})
    return out


def calls_tools(responder: object) -> bool:
    """Whether `responder` can call functions (its `calls_tools`, False when it has none)."""
    return bool(getattr(responder, "calls_tools", False))


class ResponderError(RuntimeError):
    """A responder could not produce a reply; the message says why."""


class EchoResponder:
    """Deterministic: repeats the user's last words ("You said: ..."). For tests and
    capacity runs, where the brain must cost nothing and be predictable."""

    name = "echo"

    async def reply(self, request: ReplyRequest) -> AsyncIterator[str | Incomplete]:
        """One word per delta (a word is a token here); cut at `max_output_tokens` words,
        then `Incomplete`."""
        last = next((m.text for m in reversed(request.history) if m.role == "user"), "").strip()
        text = f"You said: {last}" if last else "I did not catch that."
        words = text.split()
        cut = bool(request.max_output_tokens) and len(words) > request.max_output_tokens
        if cut:
            words = words[: request.max_output_tokens]
        for n, word in enumerate(words):
            yield word if n == len(words) - 1 else word + " "
            await asyncio.sleep(0)  # a streaming source: let other sessions run between deltas
        if cut:
            yield Incomplete()

