"""Fake engine handles for a real `Session` in a unit test (tests/unit/test_session_machine.py).

A session reaches the engines only through `EngineAccess` (server/lanes/access.py); these stand-ins
answer the calls a session and its parts make (the reply pipeline, the recogniser feed, the audio
input, semantic_vad's gate), at once and in no wall time, with what the test scripted:

- `FakeAsr`: each utterance the recogniser finishes (an item with `end`: a pause's cut or a turn's
  end) is the next text the test queued with `say()`; a text may also bring one partial hypothesis,
  answered to the utterance's first audio;
- `FakeReplies`: each responder call streams the next scripted reply (text deltas, and
  `CallDelta`s for a function call), recording its request;
- `FakeTts`: each clause is `ms_per_word` ms of a constant tone per word, loud enough that
  reply.py's `trim_lead` keeps all of it, so a reply's length and its clauses' places are known;
- `FakeVad`: a VAD row and the attach/detach/wake bookkeeping (the test plays the VAD tick itself,
  calling `Session.on_audio` with the tick's actions);
- `FakeTurns`: no end-of-turn scorer (semantic_vad is refused, as on a server without an LM).

The metrics are a real `Metrics` on a registry of its own, so a test reads its counters.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

import numpy as np
from prometheus_client import CollectorRegistry
from rtmedia.engines.asr.contract import AsrEvent, AsrItem, AsrStream
from rtmedia.engines.responders.contract import CallDelta, Incomplete, ReplyRequest, Waiting
from rtmedia.engines.tts.piper import TtsItem
from rtmedia.engines.vad.silero import VadStream
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.observe.metrics import Metrics

TONE = 3000  # the fake voice's int16 level: well over reply.py's QUIET_LEVEL
VOICE = "fake"

Delta = str | CallDelta | Incomplete | Waiting


@dataclass
class FakeTtsStream:
    """What the reply pipeline reads of a TTS stream: its rate, and whether it holds more audio."""

    voice: str
    output_rate: int
    pending: bool = False


class FakeTts:
    """Synthesis: `ms_per_word` ms of tone per word of each item; an item without words (the
    final flush) is empty."""

    def __init__(self, ms_per_word: int = 200, rate: int = 16000) -> None:
        self.ms_per_word, self.rate = ms_per_word, rate
        self.waiting = 0  # TTS items queued (a session prepares no reply at 2 or more)
        self.spoken: list[str] = []  # every item's text, in order

    @property
    def rates(self) -> dict[str, list[int]]:
        return {VOICE: [16000, 24000]}

    def open(self, voice: str = "", output_rate: int = 0, window_frames: int = 0, speed: float = 1.0
             ) -> FakeTtsStream:
        return FakeTtsStream(voice or VOICE, output_rate or self.rate)

    async def synthesize(self, item: TtsItem, priority: Priority | None = None, due: float | None = None) -> bytes:
        self.spoken.append(item.text)
        samples = item.stream.output_rate * self.ms_per_word * len(item.text.split()) // 1000
        return np.full(samples, TONE, "<i2").tobytes()


@dataclass
class Utterance:
    text: str
    partial: str = ""  # a hypothesis answered to the utterance's first audio ("": none)
    heard: bool = False  # its audio began (its partial, if any, was given)


class FakeAsr:
    """The recogniser: scripted finals, one per utterance (`say`), in the order they are asked for."""

    languages = ("en",)

    def __init__(self) -> None:
        self.utterances: deque[Utterance] = deque()
        self.items: list[AsrItem] = []
        self.open_streams = 0
        self._ids = itertools.count(1)
        self._index = 0  # utterances finished so far (the events' utterance_index)

    def say(self, text: str, partial: str = "") -> None:
        """The next utterance the recogniser finishes is `text` (`partial`: first heard as that)."""
        self.utterances.append(Utterance(text, partial))

    def open(self, segment: bool = True, fast_final: bool = False, partials: bool = True,
             prompt: str = "", language: str = "") -> AsrStream:
        self.open_streams += 1
        return AsrStream(next(self._ids), 0, segment, fast_final, partials)

    async def close(self, stream: AsrStream) -> None:
        self.open_streams -= 1

    async def recognize(self, item: AsrItem, priority: Priority | None = None) -> list[AsrEvent]:
        self.items.append(item)
        utterance = self.utterances[0] if self.utterances else None
        events = []
        if item.audio and utterance is not None and not utterance.heard:
            utterance.heard = True
            if utterance.partial:
                events.append(AsrEvent(self._index, False, utterance.partial, utterance.partial, 0, 0,
                                       hypothesis=utterance.partial))
        if item.end:
            text = self.utterances.popleft().text if self.utterances else ""
            events.append(AsrEvent(self._index, True, text, "", 0, 0, language="en"))
            self._index += 1
        return events


class FakeVad:
    """The VAD tick's handle: rows are real (empty) VAD streams; nothing steps them."""

    def __init__(self) -> None:
        self.inputs: set[object] = set()
        self.wakes = 0

    def open(self) -> VadStream:
        return VadStream()

    @property
    def attached(self) -> int:
        return len(self.inputs)

    def attach(self, audio_input: object) -> None:
        self.inputs.add(audio_input)

    def detach(self, audio_input: object) -> None:
        self.inputs.discard(audio_input)

    def wake(self) -> None:
        self.wakes += 1

    async def denoise(self, kind: str) -> object:
        raise NotImplementedError("the fake VAD has no noise suppressor")

    async def close_denoise(self, stream: object) -> None:
        pass


class FakeReplies:
    """The responders: each call streams the next scripted reply (`script`), or `default`."""

    def __init__(self, names: tuple[str, ...] = ("llm",), tool_callers: tuple[str, ...] = ("llm",)) -> None:
        self.names = list(names)
        self.tool_callers = list(tool_callers)
        self.script: deque[list[Delta]] = deque()
        self.default: list[Delta] = ["Okay."]
        self.requests: list[ReplyRequest] = []  # every reply's request, in order
        self.prepared: list[ReplyRequest] = []
        self.lagging = False  # `behind`: replies wait for the lane
        self.forgotten: list[Hashable] = []

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def add(self, *deltas: Delta) -> None:
        """The next reply streams `deltas`."""
        self.script.append(list(deltas))

    def reply(self, name: str, request: ReplyRequest, priority: Priority | None = None) -> AsyncIterator[Delta]:
        self.requests.append(request)
        deltas = self.script.popleft() if self.script else list(self.default)

        async def stream() -> AsyncIterator[Delta]:
            for delta in deltas:
                yield delta
                await asyncio.sleep(0)  # a streaming source: the loop runs between deltas

        return stream()

    def behind(self, name: str) -> bool:
        return self.lagging

    async def prepare(self, name: str, request: ReplyRequest) -> None:
        self.prepared.append(request)

    def pause(self, name: str, conversation: Hashable) -> None:
        pass

    def resume(self, name: str, conversation: Hashable) -> None:
        pass

    def forget(self, conversation: Hashable) -> None:
        self.forgotten.append(conversation)


class FakeTurns:
    """semantic_vad's scorers: none loaded."""

    available = False
    hears = False

    def forget(self, key: Hashable) -> None:
        pass


@dataclass
class FakeEngines:
    """The fakes, and the `EngineAccess` a `SessionContext` takes that holds them."""

    tts: FakeTts = field(default_factory=FakeTts)
    asr: FakeAsr = field(default_factory=FakeAsr)
    vad: FakeVad = field(default_factory=FakeVad)
    replies: FakeReplies = field(default_factory=FakeReplies)
    turns: FakeTurns = field(default_factory=FakeTurns)
    metrics: Metrics = field(default_factory=lambda: Metrics(CollectorRegistry()))

    @cached_property
    def access(self) -> EngineAccess:
        return EngineAccess(tts=cast(Any, self.tts), asr=cast(Any, self.asr), vad=cast(Any, self.vad),
                            video=cast(Any, None), replies=cast(Any, self.replies), metrics=self.metrics,
                            turns=cast(Any, self.turns))
