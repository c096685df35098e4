"""Responders: the "brain" that turns a conversation into reply text.

A responder streams text deltas for one reply; the session speaks them chunk
by chunk (docs/protocol.md#streaming-tts) as they arrive, so audio starts before the text is
complete. Responders hold no per-session state: the session passes its
conversation (already truncated to what the user heard) with each request.

A reply stream ends at the reply's natural end, or with an `Incomplete` when the token limit
(`max_output_tokens`) stopped it: the session then reports the response as incomplete.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Message:
    role: str  # "user" or "assistant"
    text: str
    # The conversation item it is (the session's id for it: conversation.item.delete and
    # .retrieve name it); responders ignore it.
    item_id: str = ""


@dataclass
class ReplyRequest:
    history: list[Message]
    instructions: str = ""
    max_output_tokens: int = 0  # 0: the responder's own limit
    images: list[bytes] = field(default_factory=list)  # camera frames, oldest first
    # The conversation (session id) the reply belongs to: an LM responder keeps its
    # KV cache between the conversation's turns.
    conversation: Hashable | None = None


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

    def reply(self, request: ReplyRequest) -> AsyncIterator[str | Waiting | Incomplete]:
        """Stream the reply's text deltas (and `Waiting` while it waits its turn; `Incomplete`
        last when the token limit stopped it)."""
        ...


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

