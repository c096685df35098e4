"""A local LM's function calls (server/lanes/responders.py LmResponder): a model whose chat template
takes tools gets them in its prompt and its reply's calls are parsed as they stream; one whose
template takes none cannot call, and sees none of the function items."""

from __future__ import annotations

from types import SimpleNamespace

from rtmedia.engines.lm.models import tiny_tokenizer
from rtmedia.engines.responders.contract import (
    CallDelta,
    CallError,
    FunctionCall,
    FunctionTool,
    Message,
    ReplyRequest,
)
from rtmedia.server.lanes.responders import LmResponder

from tests.unit.test_lm_models import TOOLS_TEMPLATE

WEATHER = FunctionTool("get_weather", "The weather now.", {"type": "object", "properties": {"city": {}}})


class Lane:
    """An LM lane that "generates" `reply` token by token and keeps the prompts it got."""

    def __init__(self, tokenizer, reply: str) -> None:
        self.engine = SimpleNamespace(tokenizer=tokenizer, context=4096)
        self.reply = reply
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, max_new, stop, key=None):
        self.prompts.append(prompt)
        for token in self.engine.tokenizer(self.reply, add_special_tokens=False)["input_ids"]:
            yield token


def responder(template: str, reply: str) -> tuple[LmResponder, Lane]:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    lane = Lane(tokenizer, reply)
    return LmResponder("transformers", lane), lane  # type: ignore[arg-type]


async def reply(lm: LmResponder, request: ReplyRequest) -> list:
    return [d async for d in lm.reply(request)]


async def test_a_tools_template_gets_the_tools_and_its_calls_stream_out_unspoken():
    lm, lane = responder(TOOLS_TEMPLATE, ' Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                         '</tool_call><tool_call>{"name": "x", "arguments": {</tool_call>')
    assert lm.calls_tools
    out = await reply(lm, ReplyRequest([Message("user", "Weather in Paris?")], tools=(WEATHER,), max_output_tokens=400))
    text = "".join(d for d in out if isinstance(d, str))
    assert text == "Sure. ", "the leading space dropped, the calls not spoken"
    assert [d for d in out if isinstance(d, CallDelta)] == [CallDelta(0, "get_weather", '{"city": "Paris"}')]
    assert [type(d) for d in out if not isinstance(d, str | CallDelta)] == [CallError]
    prompt = lane.engine.tokenizer.decode(lane.prompts[-1])
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt


async def test_tool_choice_none_renders_no_tools_and_parses_no_calls():
    lm, lane = responder(TOOLS_TEMPLATE, "<tool_call>{}</tool_call>")
    out = await reply(lm, ReplyRequest([Message("user", "hi")], tools=(WEATHER,), tool_choice="none"))
    assert "".join(out) == "<tool_call>{}</tool_call>", "a character-level model's text, token by token"
    assert "<tools>" not in lane.engine.tokenizer.decode(lane.prompts[-1])


async def test_a_named_function_is_asked_for_in_the_instructions():
    lm, lane = responder(TOOLS_TEMPLATE, "ok")
    await reply(lm, ReplyRequest([Message("user", "hi")], instructions="Be brief.", tools=(WEATHER,),
                                 tool_choice="get_weather"))
    assert "Be brief.\n\nCall the function get_weather now." in lane.engine.tokenizer.decode(lane.prompts[-1])


async def test_a_template_without_tools_cannot_call_and_sees_no_function_items():
    lm, lane = responder(tiny_tokenizer().chat_template, "Hello")
    assert not lm.calls_tools
    history = [Message("user", "hi"), Message("assistant", "", "i1", call=FunctionCall("c1", "f", "{}")),
               Message("tool", "secret output", "i2", call_id="c1"), Message("user", "and?")]
    assert "".join(await reply(lm, ReplyRequest(history))) == "Hello"
    prompt = lane.engine.tokenizer.decode(lane.prompts[-1])
    assert "secret output" not in prompt and "and?" in prompt
