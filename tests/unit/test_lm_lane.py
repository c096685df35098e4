"""The LM lane's kept conversations: a key's next generation prefills only what follows the tokens its
slot already holds, and generates exactly what a fresh slot would; kept slots are given up least
recently used first when a generation would wait, and when forgotten; prefills ahead of time never wait;
a paused generation sits out decode steps; scores (semantic_vad) are batched, reuse a key's kept
prefix and never wait, on the session's own LM lane. Through the LM responder: a reply its token limit stops ends
with Incomplete, and a conversation with an item deleted re-prefills from the deletion on and replies as
a fresh slot would.

A real LmEngine on a tiny random Llama saved to a temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from rtmedia.engines.lm.engine import LmEngine
from rtmedia.engines.lm.models import tiny_llama_dir
from rtmedia.engines.responders.contract import Incomplete, Message, ReplyRequest, Waiting
from rtmedia.server.lanes.lm_lane import LmLane, common_prefix
from rtmedia.server.lanes.responders import LmResponder
from rtmedia.server.observe.metrics import Metrics

from tests.support.waits import until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
async def lane(model_dir: Path):
    engine = LmEngine(model_dir, slots=2, context=256)
    engine.load()
    lane = LmLane("llm", engine, Metrics())
    prefills: list[int] = []
    prefill = engine.prefill

    def counting_prefill(slot: int, ids: list[int]):
        prefills.append(len(ids))
        return prefill(slot, ids)

    engine.prefill = counting_prefill  # type: ignore[method-assign]
    lane.prefills = prefills  # type: ignore[attr-defined]
    lane.start()
    yield lane
    await lane.close()
    engine.close()


async def generate(lane: LmLane, prompt: list[int], n: int = 6, key: str | None = None) -> list[int]:
    return [t async for t in lane.generate(prompt, n, key=key)]


PROMPT = [5, 17, 33, 8, 41, 12, 9, 27]


@contextlib.contextmanager
def slow_prefills(lane: LmLane, seconds: float):
    """Each prefill of the lane's engine takes `seconds` longer; the event is set when one starts."""
    prefill, started, loop = lane.engine.prefill, asyncio.Event(), asyncio.get_running_loop()

    def slow(slot: int, ids: list[int]):
        loop.call_soon_threadsafe(started.set)
        time.sleep(seconds)
        return prefill(slot, ids)

    lane.engine.prefill = slow  # type: ignore[method-assign]
    try:
        yield started
    finally:
        lane.engine.prefill = prefill  # type: ignore[method-assign]


async def test_kept_conversation_prefills_only_the_new_tokens(lane: LmLane) -> None:
    first = await generate(lane, PROMPT, key="s")
    assert lane.kept == 1 and lane.engine.slots_free == 1
    follow = [*PROMPT, *first, 3, 14, 15]
    lane.prefills.clear()
    second = await generate(lane, follow, key="s")
    # the slot held PROMPT + first[:-1] (the last token was never fed back): the rest is prefilled
    assert lane.prefills == [len(follow) - len(PROMPT) - len(first) + 1]
    assert second == await generate(lane, follow), "reuse must generate what a fresh slot generates"
    # a diverging prompt (history cut at barge-in) re-prefills from the divergence
    lane.prefills.clear()
    cut = [*PROMPT[:5], 44, 45]
    assert await generate(lane, cut, key="s") == await generate(lane, cut)
    assert lane.prefills == [2, len(cut)]


async def test_kept_slots_are_evicted_least_recent_first_and_forgotten(lane: LmLane) -> None:
    await generate(lane, PROMPT, key="a")
    await generate(lane, PROMPT[:4], key="b")
    assert lane.kept == 2 and lane.engine.slots_free == 0
    out = [t async for t in lane.generate(PROMPT[2:], 4, key="c")]
    assert len(out) == 4 and not any(isinstance(t, Waiting) for t in out), \
        "a kept slot is given up rather than making anyone wait"
    lane.prefills.clear()
    await generate(lane, PROMPT[:4], key="b")  # b survived (a was the least recently used)
    assert lane.prefills == [1]
    lane.forget("b")
    lane.forget("c")
    lane.forget("nobody")
    assert lane.kept == 0 and lane.engine.slots_free == 2


async def test_prepare_prefills_ahead_and_never_waits(lane: LmLane) -> None:
    lane.prepare("s", PROMPT)
    await until(lambda: lane.kept, what="the prepared slot kept")
    assert lane.kept == 1 and lane.prefills == [len(PROMPT)]
    lane.prefills.clear()
    assert await generate(lane, [*PROMPT, 7, 7], key="s") == await generate(lane, [*PROMPT, 7, 7])
    assert lane.prefills == [2, len(PROMPT) + 2]
    # no free slot: a prepare neither evicts other conversations nor waits; it is dropped
    await generate(lane, PROMPT, key="a")
    lane.prefills.clear()
    lane.prepare("t", PROMPT)
    await generate(lane, PROMPT[:3])  # evicts the least recent kept slot ("s"), runs after the prepare
    assert lane.prefills == [3] and lane.kept == 1 and lane.waiting == 0
    lane.forget("a")
    assert lane.engine.slots_free == 2


async def test_a_prepare_beside_a_running_generation_of_the_same_key_leaks_nothing(lane: LmLane) -> None:
    running = asyncio.create_task(generate(lane, PROMPT, 30, key="s"))
    await until(lambda: lane.engine.slots_free == 1, what="the generation taking a slot")
    lane.prepare("s", PROMPT[:3])  # takes the other slot; whichever ends last is kept
    await running
    await until(lambda: lane.kept == 1 and lane.engine.slots_free == 1, what="one slot kept, one free")
    assert lane.kept == 1 and lane.engine.slots_free == 1
    lane.forget("s")
    assert lane.engine.slots_free == 2


async def test_a_paused_generation_sits_out_decode_steps_and_resumes(lane: LmLane) -> None:
    expected = await generate(lane, PROMPT, n=8)
    held, other = [], []

    async def consume(out: list[int], key: str) -> None:
        async for token in lane.generate(PROMPT, 8, key=key):
            out.append(token)

    lane.pause("held")
    first = asyncio.create_task(consume(held, "held"))
    second = asyncio.create_task(consume(other, "other"))
    await second  # the other generation runs to its end meanwhile
    assert other == expected
    await asyncio.sleep(0.05)
    assert held == expected[:1], "only the token from the prefill, no decode step while paused"
    lane.resume("held")
    await asyncio.wait_for(first, 10)
    assert held == expected, "it resumes where it stopped and generates the same tokens"


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


async def test_a_conversation_forgotten_while_its_prompt_is_prefilled_keeps_no_slot(lane: LmLane) -> None:
    """A session that ends while its prompt (or its ahead-of-time prefix) is being prefilled
    leaves no kept slot behind."""
    with slow_prefills(lane, 0.2) as started:
        lane.prepare("gone", PROMPT)
        await asyncio.wait_for(started.wait(), 5)
        lane.forget("gone")  # the session closed meanwhile
        started.clear()
        consumer = asyncio.create_task(generate(lane, PROMPT, key="gone too"))
        await asyncio.wait_for(started.wait(), 5)
        lane.forget("gone too")
        await consumer
    await until(lambda: lane.kept == 0 and lane.engine.slots_free == lane.engine.slots_total,
                what="the forgotten slots freed")
    assert lane.kept == 0 and lane.engine.slots_free == lane.engine.slots_total


async def test_consumers_gone_before_their_prefill_free_their_slots_unprefilled(lane: LmLane) -> None:
    """Two generations admitted together, the second's consumer gone while the first is
    prefilled: the second is never prefilled and its slot is free at once."""
    with slow_prefills(lane, 0.3) as started:
        first = asyncio.create_task(generate(lane, PROMPT, n=2))
        second = asyncio.create_task(generate(lane, PROMPT[:5], n=2))
        await asyncio.wait_for(started.wait(), 5)
        second.cancel()  # its session vanished
        await asyncio.gather(second, return_exceptions=True)
        await first
    assert lane.prefills == [len(PROMPT)]
    assert lane.engine.slots_free == lane.engine.slots_total


async def test_a_reply_its_token_limit_stops_ends_incomplete(lane: LmLane) -> None:
    responder = LmResponder("llm", lane)
    request = ReplyRequest([Message("user", "Hello tiny model", "item_1")], max_output_tokens=4)
    deltas = [d async for d in responder.reply(request)]
    assert deltas[-1] == Incomplete() and not any(isinstance(d, Incomplete) for d in deltas[:-1])
    assert lane.prompts[-1] == responder.prompt(request, 4)


async def test_a_deleted_item_re_prefills_from_where_the_prompt_changed(lane: LmLane) -> None:
    """The kept slot is reused only as far as the new prompt is unchanged: deleting an item in
    the middle of the history needs no invalidation of its own, and the reply is the one a fresh
    slot gives."""
    responder = LmResponder("llm", lane)
    history = [Message("user", "My name is Ada.", "item_1"), Message("assistant", "Hi Ada.", "item_2"),
               Message("user", "I like tea.", "item_3"), Message("assistant", "Tea is nice.", "item_4"),
               Message("user", "What is my name?", "item_5")]

    async def reply(messages: list[Message], key: str | None) -> str:
        request = ReplyRequest(messages, max_output_tokens=6, conversation=key)
        return "".join([d async for d in responder.reply(request) if isinstance(d, str)])

    await reply(history, "s")
    kept = lane.prompts[-1]
    deleted = [m for m in history if m.item_id not in ("item_3", "item_4")]  # conversation.item.delete
    lane.prefills.clear()
    again = await reply(deleted, "s")
    prompt = lane.prompts[-1]
    assert lane.prefills == [len(prompt) - common_prefix(kept, prompt)] and common_prefix(kept, prompt) > 0
    assert again == await reply(deleted, None), "reuse must generate what a fresh slot generates"
    lane.forget("s")


async def test_scores_are_batched_reuse_the_kept_prefix_and_never_wait(lane: LmLane) -> None:
    """Scores asked for together run in one forward; each equals a fresh prefill's logits; a key's
    next score prefills only its new tokens; with every slot generating a score gets None at once."""
    engine = lane.engine
    batches: list[dict[int, int]] = []
    many = engine.prefill_many

    def counting_many(items):
        batches.append({slot: len(ids) for slot, ids in items.items()})
        return many(items)

    engine.prefill_many = counting_many  # type: ignore[method-assign]
    lane.prepare("a", PROMPT[:5])
    a, b = await asyncio.gather(lane.score("a", PROMPT, lambda logits: logits.clone()),
                                lane.score("b", PROMPT[:6], lambda logits: int(logits.argmax())))
    assert sorted(batches[-1].values()) == [3, 6]  # one batch: "a" only what follows its prepared prefix
    assert isinstance(b, int) and lane.kept == 2
    await lane.score("a", [*PROMPT, 7], lambda logits: None)
    assert list(batches[-1].values()) == [1]
    lane.forget("b")
    free = engine.acquire()
    fresh = engine.prefill(free, PROMPT)
    engine.release(free)
    assert (a - fresh).abs().max() < 1e-4
    lane.forget("a")
    first = lane.generate(PROMPT, 50)
    second = lane.generate(PROMPT, 50)
    await first.__anext__(), await second.__anext__()  # both slots generating
    assert await lane.score("c", PROMPT, lambda logits: 1) is None
    await first.aclose(), await second.aclose()


async def test_the_turn_scorer_runs_on_the_sessions_own_lm_lane(lane: LmLane) -> None:
    """engine_access.Turns: a session whose responder is an LM lane's is scored on that lane (here a
    tiny model without a chat template); any other responder on the embedded model's lane."""
    from rtmedia.server.lanes.access import Turns

    turns = Turns(None, {"transformers": lane})  # type: ignore[arg-type]
    assert turns.available
    score = await turns.score("transformers", ("turn", "s"), "Hi.", "book a table")
    assert isinstance(score, float) and score <= 0 and lane.kept == 1
    turns.forget(("turn", "s"))
    assert lane.kept == 0
