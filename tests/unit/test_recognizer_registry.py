"""Adding a recogniser is one class and one registry entry: a fake one, registered by name, serves
the whole server's Transcribe (engines/asr/registry.py, server/lanes/recognizer.py)."""

from __future__ import annotations

import itertools
import threading
import typing
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
from rtmedia.engines.asr.contract import (
    ENGLISH,
    AsrEvent,
    AsrItem,
    AsrStream,
    LaneGauge,
    LanePlan,
    Recognizer,
    RecognizerSettings,
    by_stream,
    language_code,
)
from rtmedia.engines.asr.registry import RECOGNIZERS
from rtmedia.engines.base import EngineError
from rtmedia.engines.registry import Registry
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

FAKE = "fake-words"
WORD = "pineapple"


class FakeRecognizer:
    """Hears one fixed word in every utterance that had audio; it cuts utterances itself (an
    utterance ends on `end=True`), so the server sends it the audio as it comes."""

    name = "asr"
    model = "fake-words"
    languages = ENGLISH
    finds_utterances = True
    takes_prompt = False
    workers = 1
    graph_stats = None

    def __init__(self, settings: RecognizerSettings) -> None:
        self.settings = settings
        self.loaded = self.closed = False
        self.items: list[AsrItem] = []
        self.urgent_steps = 0
        self._open: dict[int, int] = {}  # stream id -> audio bytes of its open utterance
        self._ids = itertools.count(1)
        self._mu = threading.Lock()

    @property
    def describe(self) -> dict[str, str]:
        return {"model": self.model, "path": "", "runtime": "fake", "compute_type": "", "languages": "en"}

    @property
    def open_streams(self) -> int:
        return len(self._open)

    @property
    def lane_plan(self) -> LanePlan:
        return LanePlan(max_batch=8, runners=1, shard=by_stream,
                        gauges=(LaneGauge("asr_streams", "0", lambda: self.open_streams),))

    def load(self) -> None:
        self.loaded = True

    def warmup(self) -> None:
        self.load()

    def fault(self) -> str | None:
        return None

    def close(self) -> None:
        self.closed = True

    def open_stream(self, segment: bool = True, fast_final: bool = False, partials: bool = True,
                    prompt: str = "", language: str = "") -> AsrStream:
        language_code(language, self.languages)
        with self._mu:
            stream = AsrStream(next(self._ids), 0, segment, fast_final, partials)
            self._open[stream.id] = 0
            return stream

    def close_stream(self, stream: AsrStream) -> None:
        with self._mu:
            self._open.pop(stream.id, None)

    def step(self, items: Sequence[AsrItem], urgent: bool = False) -> list[list[AsrEvent] | EngineError]:
        self.urgent_steps += urgent
        results: list[list[AsrEvent] | EngineError] = []
        with self._mu:
            for item in items:
                self.items.append(item)
                if item.stream.id not in self._open:
                    results.append(EngineError("no such stream"))
                    continue
                self._open[item.stream.id] += len(item.audio)
                if not item.end:
                    results.append([])
                    continue
                heard, self._open[item.stream.id] = self._open[item.stream.id], 0
                end_ms = heard * 1000 // (2 * 16000)
                results.append([AsrEvent(0, True, WORD if heard else "", "", 0, end_ms, language="en")]
                               if heard else [])
        return results


def test_a_registry_builds_by_name_and_lists_its_names() -> None:
    kinds: Registry[str] = Registry("greeting")
    kinds.add("hello", lambda who: f"hello {who}")
    assert kinds.names() == ("hello",) and "hello" in kinds and len(kinds) == 1
    assert kinds.build("hello", "you") == "hello you"
    with pytest.raises(ValueError, match="greeting 'bye': expected one of hello"):
        kinds.build("bye")
    with pytest.raises(ValueError, match="registered already"):
        kinds.add("hello", str)
    assert RECOGNIZERS.names()[:2] == ("whisper", "pocketsphinx")


def test_the_backends_implement_the_contract() -> None:
    from rtmedia.engines.asr.pocketsphinx import AsrEngine
    from rtmedia.engines.asr.whisper import WhisperEngine

    # the contract's members, looked up on the classes (an unloaded engine's properties may raise)
    members = typing._get_protocol_attrs(Recognizer)  # type: ignore[attr-defined]
    for engine in (AsrEngine(workers=1), WhisperEngine(), FakeRecognizer(RecognizerSettings())):
        assert not [name for name in members if not (hasattr(type(engine), name) or name in vars(engine))], engine
    plan = AsrEngine(workers=3).lane_plan
    assert (plan.max_batch, plan.runners, plan.final_runners) == (64, 3, 3)
    assert [g.metric for g in plan.gauges].count("asr_decoders") == 3
    whisper = WhisperEngine(inter_threads=4).lane_plan
    assert (whisper.max_batch, whisper.runners, whisper.final_runners, whisper.final_shard) == (256, 4, 1, None)


@pytest.fixture
def fake_recognizer():
    built: list[FakeRecognizer] = []

    def factory(settings: RecognizerSettings) -> FakeRecognizer:
        built.append(FakeRecognizer(settings))
        return built[-1]

    RECOGNIZERS.add(FAKE, factory)
    try:
        yield built
    finally:
        RECOGNIZERS.remove(FAKE)


async def test_the_whole_server_transcribes_with_a_registered_recognizer(fake_recognizer) -> None:
    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, llm=False, default_responder="echo", asr=FAKE,
                                           asr_workers=3))
    await server.start()
    try:
        [fake] = fake_recognizer
        assert fake.loaded and fake.settings.workers == 3
        assert server.scheduler.lanes["asr"].engine is fake and server.scheduler.lanes["asr_final"].engine is fake
        pcm = (np.sin(np.arange(16000) / 8) * 3000).astype(np.int16).tobytes()
        config = speech_pb2.TranscribeConfig(audio_format=common_pb2.AudioFormat(sample_rate=16000))

        async def requests():
            yield speech_pb2.TranscribeRequest(config=config)
            yield speech_pb2.TranscribeRequest(audio=pcm)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = speech_pb2_grpc.SpeechServiceStub(channel)
            finals = [r async for r in stub.Transcribe(requests()) if r.is_final]
            described = await stub.DescribeRecognizer(speech_pb2.DescribeRecognizerRequest())
        assert [f.text for f in finals] == [WORD]
        assert described.name == "fake-words" and described.runtime == "fake"
        assert sum(len(item.audio) for item in fake.items) == len(pcm) and fake.items[-1].end
        assert server.metrics.registry.get_sample_value("rtmedia_asr_streams", {"worker": "0"}) == 0
    finally:
        await server.stop(0)
    assert fake.closed
