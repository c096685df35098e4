"""The LM lane: continuous batching of every generating session on one LM engine.

A generation asks for a KV-cache slot; while none is free it waits in FIFO
order (its session says so with response.waiting; it is never refused). Once
admitted its prompt is prefilled into the slot, then each iteration of the
lane's loop runs ONE batched decode step for all generations in the decode
phase, samples the next tokens (greedy), and hands them to their consumers.
A generation ends on an end-of-sequence token, at its token limit, or when
its consumer goes away (barge-in); its slot is freed within that iteration.
A conversation the scheduler is asked to `pause` sits out the decode steps
until it is resumed (a session asks while its reply's first clause is
synthesised, so that synthesis has the CPU); other conversations go on.
The engine runs in the lane's own thread, never on the event loop.

Kept conversations. A generation may carry a conversation key (the session
id). When it ends, its slot is kept for that key with the tokens it holds
(the prompt and every token decoded), and the key's next generation prefills
only what follows the longest common prefix of those tokens and its new
prompt: the system prompt and the history are not recomputed each turn, and a
history cut at barge-in simply re-prefills from the cut. `prepare(key, ids)`
prefills a prompt's known prefix ahead of time (the session calls it when the
user starts speaking) when a slot is free. Kept slots are given up, least
recently used first, whenever a generation would otherwise wait, and when
their session ends (`forget`).

Scores. `score(key, prompt, reduce)` is a prefill-only item (semantic_vad's end-of-turn
scorer, engines/turn/scorers.py): the prompt goes into the key's kept slot (reusing its common prefix,
like a generation) and `reduce` of the last logits comes back. Scores run first in each
iteration, all of them in one batched forward, before admissions and the decode step, and never
wait: one that finds no slot (every slot generating) gets None at once.

Faults (the scheduler's rules, server/lanes/scheduler.py). A prefill or decode step
that raises fails the generations of that step only, with a `StepFailed` naming
the lane (an out-of-memory decode included: the next step has fewer to do, and a
generation that fails leaves its slot). A step past `step_deadline_s` fails its
generations at the deadline; the engine takes no other step until it returns,
so meanwhile every other generation fails and a new one is refused at once
(`LaneStalled`, retryable); kept slots stay kept. When the step returns, the lane
takes work again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rtmedia.engines.responders.contract import Waiting
from rtmedia.server.lanes.faults import LaneStalled, StepDeadlineExceeded, step_failed
from rtmedia.server.lanes.lane_base import LaneHealth, Priority, wait_step
from rtmedia.server.observe.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Generation:
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    slot: int | None = None
    last: int | None = None  # the token to feed next
    produced: int = 0
    cancelled: bool = False
    error: BaseException | None = None
    key: Hashable | None = None  # the conversation whose slot it keeps
    prepare_only: bool = False  # prefill the prompt and keep it; never waits
    cached: list[int] = field(default_factory=list)  # the tokens the slot holds
    conversation: Hashable | None = None  # whom a pause applies to (kept when `key` is dropped)
    finished: bool = False  # its consumer has been told the end (tokens got None)
    scored: asyncio.Future[Any] | None = None  # a score: reduce(last logits), or None without a slot
    reduce: Any = None


@dataclass
class Kept:
    slot: int
    tokens: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LmLane:
    """Owns one LM engine (`acquire/release/prefill/decode`, see engines/lm/engine.py)."""

    priority = Priority.INTERACTIVE

    def __init__(self, name: str, engine: Any, metrics: Metrics, step_deadline_s: float | None = None) -> None:
        self.engine = engine
        self.name = name
        self._metrics = metrics
        self.step_deadline_s = step_deadline_s
        self.health = LaneHealth()
        self._hung: asyncio.Future[Any] | None = None  # a step past its deadline, until it returns
        self._step_started = 0.0
        self._paused: set[Hashable] = set()
        self._admitted: list[Generation] = []  # admitted this iteration (being prefilled)
        self._waiting: deque[Generation] = deque()
        self._scores: list[Generation] = []  # scores asked for since the last score step
        self._scoring: list[Generation] = []  # the score step's
        self._active: list[Generation] = []
        self._kept: OrderedDict[Hashable, Kept] = OrderedDict()  # least recently used first
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.name}")
        self._task: asyncio.Task[None] | None = None
        self.prompts: deque[list[int]] = deque(maxlen=64)  # recent prompts, for tests and debugging

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lm-lane-{self.name}")

    @property
    def kept(self) -> int:
        return len(self._kept)

    def prepare(self, key: Hashable, prompt: Sequence[int]) -> None:
        """Prefill `prompt` into `key`'s slot ahead of its next generation, if a slot is free then."""
        if prompt:
            self._waiting.append(Generation(list(prompt), 0, frozenset(), key=key, prepare_only=True))
            self._wake.set()

    async def score(self, key: Hashable, prompt: Sequence[int], reduce: Any) -> Any:
        """`reduce(logits)` (run in the lane's thread) of the next-token logits after `prompt`,
        prefilled into `key`'s kept slot; None when no slot could be had. See the module docstring."""
        if self._hung is not None:
            raise self._stalled_error()
        future = asyncio.get_running_loop().create_future()
        self._scores.append(Generation(list(prompt), 0, frozenset(), key=key, scored=future, reduce=reduce))
        self._wake.set()
        return await future

    def forget(self, key: Hashable) -> None:
        """The conversation is over: give up its kept slot and keep nothing more for it."""
        self.resume(key)
        for generation in [*self._active, *self._waiting, *self._admitted, *self._scoring, *self._scores]:
            if generation.key == key:  # (prefilling and scoring ones too)
                generation.key = None
                generation.cancelled |= generation.prepare_only  # a prefix nobody will use
        if (kept := self._kept.pop(key, None)) is not None:
            self.engine.release(kept.slot)
            self._update_gauges()

    def pause(self, conversation: Hashable) -> None:
        """The conversation's generations sit out the decode steps until `resume`."""
        self._paused.add(conversation)

    def resume(self, conversation: Hashable) -> None:
        if conversation in self._paused:
            self._paused.discard(conversation)
            self._wake.set()

    async def generate(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                       key: Hashable | None = None) -> AsyncIterator[int | Waiting]:
        """Stream generated token ids, first a `Waiting(queue position)` when no slot is free.
        With a `key`, the slot is kept for the key's next generation (see the module docstring),
        and `pause(key)` holds the generation back."""
        if self._hung is not None:
            raise self._stalled_error()
        generation = Generation(list(prompt), max_new_tokens, frozenset(stop_ids), key=key, conversation=key)
        self.prompts.append(generation.prompt)
        if len(self._waiting) >= self.engine.slots_free + len(self._kept):  # no slot it could take
            yield Waiting(len(self._waiting))
        self._waiting.append(generation)
        self._update_gauges()
        self._wake.set()
        try:
            while (token := await generation.tokens.get()) is not None:
                yield token
            if generation.error is not None:
                raise generation.error
        finally:
            generation.cancelled = True  # the loop frees its slot (or drops it from the queue)
            self._wake.set()

    def _update_gauges(self) -> None:
        free, kept = self.engine.slots_free, len(self._kept)
        self._metrics.lm_slots.labels("busy").set(self.engine.slots_total - free - kept)
        self._metrics.lm_slots.labels("kept").set(kept)
        self._metrics.lm_slots.labels("free").set(free)
        self._metrics.lm_slots.labels("waiting").set(len(self._waiting))

    def _finish(self, generation: Generation, error: BaseException | None = None) -> None:
        if generation.finished:
            return
        generation.finished = True
        if generation.slot is not None:
            if generation.key is not None and error is None:
                if (older := self._kept.pop(generation.key, None)) is not None:
                    self.engine.release(older.slot)
                self._kept[generation.key] = Kept(generation.slot, generation.cached)
            else:
                self.engine.release(generation.slot)
            generation.slot = None
        generation.error = error
        generation.tokens.put_nowait(None)

    def _emit(self, generation: Generation, logits: Any) -> None:
        token = int(logits.argmax())
        generation.produced += 1
        if token in generation.stop_ids:
            self._finish(generation)
            return
        generation.tokens.put_nowait(token)
        generation.last = token
        if generation.produced >= generation.max_new_tokens:
            self._finish(generation)

    async def _run(self) -> None:
        while True:
            if self._hung is not None:
                await self._wait_hung()
            # Drop consumers that went away, admit waiting generations into free slots.
            for generation in [g for g in self._active if g.cancelled]:
                self._finish(generation)
            self._active = [g for g in self._active if g.slot is not None]
            self._waiting = deque(g for g in self._waiting if not g.cancelled)
            if self._scores:
                await self._run_scores()
            admitted = self._admitted = []
            while self._waiting:
                generation = self._waiting[0]
                if (slot := self._slot_for(generation)) is None and not generation.prepare_only:
                    break  # FIFO: wait for a slot
                self._waiting.popleft()
                if slot is None:
                    continue  # a prefill ahead of time never waits
                generation.slot = slot
                admitted.append(generation)
            self._update_gauges()
            if not admitted and not self._active and not self._scores:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            for generation in admitted:
                if generation.cancelled:  # its consumer left while others were prefilled
                    self._finish(generation)
                    continue
                if self._hung is not None:  # an earlier prefill of this iteration is past its deadline
                    self._finish(generation, self._stalled_error())
                    continue
                new = generation.prompt[len(generation.cached):]
                try:
                    logits = await self._timed("prefill", self.engine.prefill, generation.slot, new)
                except StepDeadlineExceeded as exc:
                    self._finish(generation, exc)
                    continue
                except Exception as exc:
                    self._finish(generation, self._failed(exc, "prefill", 1))
                    continue
                self.health.step_done(True)
                generation.cached += new
                if generation.prepare_only:
                    self._finish(generation)
                    continue
                self._active.append(generation)
                self._emit(generation, logits)
            decoding = [g for g in self._active if g.slot is not None and g.last is not None and not g.cancelled]
            decoding = [g for g in decoding if g not in admitted and g.conversation not in self._paused]
            if decoding and self._hung is None:
                tokens = {g.slot: g.last for g in decoding}
                try:
                    results = await self._timed("decode", self.engine.decode, tokens)
                except StepDeadlineExceeded as exc:
                    for generation in decoding:
                        self._finish(generation, exc)
                except Exception as exc:
                    fault = self._failed(exc, "decode step", len(decoding))
                    for generation in decoding:
                        self._finish(generation, fault)
                else:
                    self.health.step_done(True)
                    for generation, token in zip(decoding, tokens.values(), strict=True):
                        generation.cached.append(token)  # its K/V is in the slot now
                        if generation.slot is not None and not generation.cancelled:
                            self._emit(generation, results[generation.slot])
                self._metrics.lane_batch_size.labels(self.name).observe(len(tokens))
            if self._hung is not None:
                continue
            if not admitted and not decoding and not self._scores:  # all paused: wait for a resume
                self._wake.clear()
                await self._wake.wait()
                continue
            self._metrics.lane_step_seconds.labels(self.name).observe(time.perf_counter() - started)
            await asyncio.sleep(0)  # let consumers run between steps

    async def _run_scores(self) -> None:
        """Every pending score in one batched prefill (a key scored twice: its latest prompt)."""
        pending, self._scores = self._scores, []
        latest = {g.key: g for g in pending}
        batch: list[Generation] = []
        for generation in pending:
            assert generation.scored is not None
            if latest[generation.key] is not generation or generation.scored.done() or generation.key is None:
                generation.scored.cancel()
            elif (slot := self._slot_for(generation)) is None:
                generation.scored.set_result(None)
            else:
                generation.slot = slot
                batch.append(generation)
        if not batch:
            return
        self._scoring = batch
        items = {g.slot: g.prompt[len(g.cached):] for g in batch}
        reducers = {g.slot: g.reduce for g in batch}
        started = time.perf_counter()

        def step() -> dict[int, Any]:
            return {slot: reducers[slot](logits) for slot, logits in self.engine.prefill_many(items).items()}

        try:
            results = await self._timed("score", step)
        except Exception as exc:
            self._scoring = []
            if not isinstance(exc, StepDeadlineExceeded):
                exc = self._failed(exc, "score step", len(batch))
            for generation in batch:
                self._finish(generation, exc)
                if not generation.scored.done():  # type: ignore[union-attr]
                    generation.scored.set_exception(exc)  # type: ignore[union-attr]
            return
        self._scoring = []
        self.health.step_done(True)
        self._metrics.turn_score_batch.observe(len(batch))
        self._metrics.lane_step_seconds.labels(self.name).observe(time.perf_counter() - started)
        for generation in batch:
            generation.cached = list(generation.prompt)
            slot = generation.slot
            self._finish(generation)  # the slot is kept for the key
            if not generation.scored.done():  # type: ignore[union-attr]
                generation.scored.set_result(results[slot])  # type: ignore[union-attr,index]

    def _failed(self, exc: Exception, what: str, items: int) -> Exception:
        """A step raised: logged and counted; the StepFailed its items fail with."""
        log.exception("lane %s: %s failed (%d items)", self.name, what, items)
        self.health.step_done(False)
        self._metrics.lane_step_failures.labels(self.name).inc()
        return step_failed(self.name, exc, what)

    async def _timed(self, what: str, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the lane's thread, within the step deadline."""
        self._step_started = time.monotonic()
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        return await wait_step(future, self.step_deadline_s, lambda: self._late(what, future))

    def _late(self, what: str, future: asyncio.Future[Any]) -> StepDeadlineExceeded:
        self._hung = future
        self.health.hung[0] = time.monotonic()
        self._metrics.lane_deadline_misses.labels(self.name).inc()
        log.error("lane %s: a %s step ran past its %g s deadline; its generations failed, and the lane takes no "
                  "other step until it returns", self.name, what, self.step_deadline_s)
        return StepDeadlineExceeded(self.name, f"the {self.name} lane's {what} step ran past its "
                                               f"{self.step_deadline_s:g} s deadline; this reply failed")

    def _stalled_error(self) -> LaneStalled:
        return LaneStalled(self.name, f"the {self.name} lane is stalled: a step has run "
                                      f"{time.monotonic() - self._step_started:.1f} s, past its "
                                      f"{self.step_deadline_s:g} s deadline, and the model takes no other step "
                                      "until it returns; retry shortly")

    async def _wait_hung(self) -> None:
        """A step is past its deadline: fail every generation (none can step until it returns), wait
        for it, then take work again. Kept slots stay kept."""
        assert self._hung is not None
        error = self._stalled_error()
        for generation in [*self._active, *self._waiting, *self._admitted]:
            self._finish(generation, error)
        for generation in self._scores:
            if generation.scored is not None and not generation.scored.done():
                generation.scored.set_exception(error)
        self._scores = []
        self._active, self._admitted = [], []
        self._waiting.clear()
        self._update_gauges()
        await asyncio.wait({self._hung})
        self._hung = None
        self.health.hung.pop(0, None)
        log.warning("lane %s: the step past its deadline ended after %.1f s; the lane takes work again",
                    self.name, time.monotonic() - self._step_started)

    def _slot_for(self, generation: Generation) -> int | None:
        """A slot for the generation, with `cached` set to the tokens of its prompt the slot already holds:
        its key's kept slot, a free one, or (unless it only prepares) the least recently kept one."""
        kept = self._kept.pop(generation.key, None) if generation.key is not None else None
        if kept is not None:
            reuse = min(common_prefix(kept.tokens, generation.prompt), len(generation.prompt) - 1)
            self.engine.truncate(kept.slot, reuse)
            generation.cached = generation.prompt[:reuse]
            return kept.slot
        generation.cached = []
        slot = self.engine.acquire()
        if slot is None and self._kept and not generation.prepare_only:
            _, oldest = self._kept.popitem(last=False)
            self.engine.release(oldest.slot)
            slot = self.engine.acquire()
        return slot

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for generation in [*self._active, *self._waiting]:
            generation.key = None
            self._finish(generation)
        for generation in self._scores:
            if generation.scored is not None:
                generation.scored.cancel()
        for kept in self._kept.values():
            self.engine.release(kept.slot)
        self._kept.clear()
        self._executor.shutdown(wait=self._hung is None, cancel_futures=True)  # a hung step is not waited for
