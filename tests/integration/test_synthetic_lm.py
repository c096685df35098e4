"""`rtmedia serve --synthetic-lm tiny`: the llm lane on a random-weight Llama answers a
response.create with text (gibberish by design) through the real lane, and its graph runner
counts every CPU step as an `ineligible` miss in the metrics."""

from __future__ import annotations

from rtmedia.engines.lm.synthetic import SyntheticLmEngine

from tests.support.converse import Conversation

SERVER_OPTIONS = {"llm": True, "synthetic_lm": "tiny", "default_responder": "llm", "lm_slots": 2,
                  "lm_context": 256, "device": "auto"}


async def test_synthetic_llm_answers_with_text(server, channel):
    engine = server.scheduler.lanes["llm"].engine
    assert isinstance(engine, SyntheticLmEngine) and server.placement.device.type in ("cpu", "cuda")
    async with Conversation(channel) as c:
        c.send("session.update", session={"max_output_tokens": 12})
        c.send("conversation.item.create", item={"text": "Say something."})
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=60)
        assert done["status"] in ("completed", "incomplete"), done  # gibberish: usually all 12 tokens
        text = c.of_type("response.output_text.done")[0]["text"]
    assert text.strip(), text  # printable characters only: special tokens never win
    sample = server.metrics.registry.get_sample_value
    steps = (sample("rtmedia_graph_replays_total", {"engine": "llm"}) or 0) + \
        (sample("rtmedia_graph_misses_total", {"engine": "llm", "reason": "ineligible"}) or 0)
    assert steps >= 12  # warm-up and this reply's prefill and decode steps
