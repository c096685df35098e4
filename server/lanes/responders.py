"""The responders a server offers, and the LM-backed one (`llm`, `transformers`).

An LM responder turns the conversation into a chat prompt, streams tokens
from its LM lane (shared by every session generating on that model) and
detokenizes them incrementally into text deltas. A reply that used up its token
limit ends with `Incomplete` (the lane stops at an end-of-sequence token, which it
does not pass on, or at the limit: so all `max_new` tokens arriving means the limit).

Kept KV slots need nothing from here when the conversation changes: the lane reuses
only the longest common token prefix of the slot and the new prompt, so a deleted or
truncated item simply re-prefills the prompt from where it differs.

A model whose chat template takes tools (in a form engines/responders/tool_parsers.py reads) can call
functions: the prompt is rendered with the session's tools, and the reply's text goes through
the form's parser as it streams, so the text before a call is spoken and the call is not.
A local model cannot be made to call: tool_choice "required" or a function's name is asked
for in the instructions. A model whose template takes no tools sees none of the function
items a client may record in its history.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Hashable
from typing import Any

from rtmedia.engines.lm.models import Detokenizer, truncate_history_to_fit
from rtmedia.engines.responders.contract import (
    CallDelta,
    CallError,
    EchoResponder,
    Incomplete,
    Message,
    ReplyRequest,
    Responder,
    Waiting,
)
from rtmedia.engines.responders.tool_parsers import parser_for
from rtmedia.server.lanes.lm_lane import LmLane, common_prefix

# Voice replies are short: the cap when a request leaves max_output_tokens at its default.
DEFAULT_MAX_TOKENS = 256


class LmResponder:
    """Replies from a local causal LM through an LmLane."""

    def __init__(self, name: str, lane: LmLane) -> None:
        self.name = name
        self.lane = lane

    @property
    def tokenizer(self) -> Any:
        return self.lane.engine.tokenizer

    @property
    def calls_tools(self) -> bool:
        return parser_for(getattr(self.tokenizer, "chat_template", None)) is not None

    def prompt(self, request: ReplyRequest, max_new: int) -> list[int]:
        """The chat prompt (with the tools, unless tool_choice is "none"); the oldest turns go
        first when it would not fit the context."""
        tools = request.tools if request.tool_choice != "none" and self.calls_tools else ()
        history = request.history if self.calls_tools else \
            [m for m in request.history if m.call is None and m.role != "tool"]  # calls a client recorded
        instructions = request.instructions
        if tools and request.tool_choice != "auto":
            which = "one of the functions" if request.tool_choice == "required" else \
                f"the function {request.tool_choice}"
            instructions = f"{instructions}\n\nCall {which} now.".strip()
        _, ids = truncate_history_to_fit(self.tokenizer, history, instructions, max_new, self.lane.engine.context,
                                         tools)
        return ids

    async def prepare(self, request: ReplyRequest) -> None:
        """Prefill what the next prompt holds before the user's words (instructions, history)."""
        if request.conversation is not None:
            prefix = await asyncio.to_thread(self._known_prefix, request)
            self.lane.prepare(request.conversation, prefix)

    def _known_prefix(self, request: ReplyRequest) -> list[int]:
        max_new = _max_new(request)
        a, b = (self.prompt(dataclasses.replace(request, history=[*request.history, Message("user", word)]), max_new)
                for word in ("yes", "no"))
        return a[:common_prefix(a, b)]

    def forget(self, conversation: Hashable) -> None:
        self.lane.forget(conversation)

    async def reply(self, request: ReplyRequest) -> AsyncIterator[str | Waiting | Incomplete | CallDelta | CallError]:
        max_new = _max_new(request)
        tokenizer = self.tokenizer
        prompt = await asyncio.to_thread(self.prompt, request, max_new)
        stop = {t for t in (tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)) if t is not None}
        text = Detokenizer(tokenizer)
        parser_class = parser_for(tokenizer.chat_template) if request.tools and request.tool_choice != "none" \
            else None
        parser = parser_class() if parser_class is not None else None
        started = False  # the reply's leading whitespace is dropped
        received = 0

        def passed(outputs: list[str | CallDelta | CallError]) -> list[str | CallDelta | CallError]:
            nonlocal started
            out = []
            for item in outputs:
                if isinstance(item, str):
                    item = item if started else item.lstrip()
                    if not item:
                        continue
                    started = True
                out.append(item)
            return out

        async for token in self.lane.generate(prompt, max_new, sorted(stop), key=request.conversation):
            if isinstance(token, Waiting):
                yield token
                continue
            received += 1
            delta = text.push(token)
            for item in passed(parser.feed(delta) if parser is not None else [delta]):
                yield item
        if parser is not None:
            for item in passed(parser.flush()):
                yield item
        if received >= max_new:
            yield Incomplete()


def _max_new(request: ReplyRequest) -> int:
    return min(request.max_output_tokens or DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)


def build_responders(lanes: dict[str, LmLane], extra: dict[str, Responder] | None = None) -> dict[str, Responder]:
    """Every responder this server offers: echo, one per LM lane, and any others given."""
    responders: dict[str, Responder] = {"echo": EchoResponder()}
    responders.update({name: LmResponder(name, lane) for name, lane in lanes.items()})
    responders.update(extra or {})
    return responders
