"""The typed handles sessions and servicers use (server/lanes/access.py), on a real
scheduler with fake engines: which lane an ASR item takes, the recogniser's languages and the
language a stream opens with, and that a reply of a responder that is not an LM's runs as a
call its stream lane owns."""

from __future__ import annotations

import asyncio

import pytest
from rtmedia.engines.asr.contract import AsrItem, AsrStream
from rtmedia.engines.responders.contract import EchoResponder, Incomplete, Message, ReplyRequest
from rtmedia.server.lanes.access import ASR, ASR_FINAL, Asr, Replies
from rtmedia.server.lanes.scheduler import LanePolicy, Priority, Scheduler
from rtmedia.server.observe.metrics import Metrics


class Recorder:
    name = "asr"

    def __init__(self) -> None:
        self.steps: list[tuple[str, list[AsrItem]]] = []

    def load(self) -> None: ...
    def warmup(self) -> None: ...
    def close(self) -> None: ...

    def step(self, items, urgent: bool = False):
        self.steps.append(("urgent" if urgent else "step", list(items)))
        return [[] for _ in items]


@pytest.fixture
async def scheduler():
    s = Scheduler(Metrics())
    yield s
    await s.close()


async def test_an_item_that_only_ends_an_utterance_takes_the_final_lane(scheduler):
    engine = Recorder()
    scheduler.add(ASR, engine, LanePolicy(Priority.REALTIME))
    scheduler.add(ASR_FINAL, engine, LanePolicy(Priority.REALTIME), lambda items: engine.step(items, urgent=True))
    scheduler.start()
    asr = Asr(scheduler)
    stream = AsrStream(1, 0, False, True)
    await asr.recognize(AsrItem(stream, b"\0\0" * 8))
    await asr.recognize(AsrItem(stream, b"", end=True))
    await asr.recognize(AsrItem(stream, b"\0\0", end=True))  # an end behind audio travels with it
    assert [kind for kind, _ in engine.steps] == ["step", "urgent", "step"]


class Multilingual(Recorder):
    """A stand-in for a multilingual recogniser: what the facade asks of it, and the streams opened."""

    model = "whisper-small"

    def __init__(self) -> None:
        super().__init__()
        self.languages = ("en", "fr", "de")
        self.describe = {"model": "whisper-small", "path": "/models/whisper-small", "runtime": "ct2",
                         "compute_type": "int8", "languages": "multilingual"}
        self.opened: list[dict] = []

    def open_stream(self, segment=True, fast_final=False, partials=True, prompt="", language=""):
        self.opened.append({"segment": segment, "prompt": prompt, "language": language})
        return AsrStream(len(self.opened), 0, segment)


def test_the_recognisers_languages_and_a_language_asked_for(scheduler):
    engine = Multilingual()
    scheduler.add(ASR, engine, LanePolicy(Priority.REALTIME))
    asr = Asr(scheduler)
    assert asr.languages == ("en", "fr", "de") and asr.multilingual
    assert [asr.language(code) for code in ("fr-FR", "FR", "fr_CA", "french", "", "en-US")] == \
        ["fr", "fr", "fr", "fr", "", "en"]
    with pytest.raises(ValueError, match=r"language 'es-ES' is not served by this recogniser; it serves 3 "
                                         r"languages \(en, fr, de\)"):
        asr.language("es-ES")
    with pytest.raises(ValueError, match=r"^language_code 'x'"):
        asr.language("x", "language_code")
    asr.open(segment=False, prompt="Bonjour.", language=asr.language("fr-FR"))
    assert engine.opened == [{"segment": False, "prompt": "Bonjour.", "language": "fr"}]
    assert asr.describe == {"model": "whisper-small", "languages": ("en", "fr", "de"), "multilingual": True,
                            "runtime": "ct2", "compute_type": "int8"}
    engine.languages = ("en",)  # an English-only model
    assert not asr.multilingual and asr.language("english") == "en"
    with pytest.raises(ValueError, match=r"it serves en \(an English-only model\)"):
        asr.language("fr-FR")


class Slow:
    """A responder whose reply streams slowly, as one from an HTTP server would."""

    name = "slow"

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def reply(self, request: ReplyRequest):
        try:
            for word in ("one ", "two ", "three"):
                yield word
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_reply_runs_on_its_stream_lane_and_stops_with_its_caller(scheduler):
    slow = Slow()
    for name in ("echo", "slow"):
        scheduler.add_stream(f"reply-{name}", LanePolicy(concurrency=4))
    scheduler.start()
    replies = Replies(scheduler, {"echo": EchoResponder(), "slow": slow})
    request = ReplyRequest([Message("user", "hello there")], conversation="sess_1")
    assert "".join([d async for d in replies.reply("echo", request)]) == "You said: hello there"
    stream = replies.reply("slow", request)
    assert await anext(stream) == "one "
    assert [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("lane-reply-slow")]
    await stream.aclose()  # the session's response was cancelled
    await asyncio.wait_for(slow.cancelled.wait(), 1)
    assert replies.names == ["echo", "slow"] and "slow" in replies and "llm" not in replies
    replies.pause("echo", "sess_1")  # not an LM: nothing to hold back, and no error
    replies.resume("echo", "sess_1")


async def test_echo_stops_at_max_output_tokens_and_says_the_limit_did():
    echo = EchoResponder()
    request = ReplyRequest([Message("user", "one two three four", "item_1")], max_output_tokens=3)
    assert [d async for d in echo.reply(request)] == ["You ", "said: ", "one", Incomplete()]
    request.max_output_tokens = 6  # exactly the reply: its natural end
    assert [d async for d in echo.reply(request)] == ["You ", "said: ", "one ", "two ", "three ", "four"]
