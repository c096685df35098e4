"""A server that hears through a Whisper it was given (`asr_model`) on the torch runtime
(`asr_backend torch`): the APIs name the directory's model and runtime, it transcribes a
sentence as the default does, and its encoder calls go through the graph runner (eager on a
CPU, counted in the metrics)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc
from rtmedia.engines.asr.whisper_model import embedded_model_dir
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

from tests.support.speech import Speaker, wer

SENTENCE = "How many legs does a spider have?"
NAME = "whisper-tiny.en-ct2"


@pytest.fixture(scope="module")
async def server(tmp_path_factory):
    """The embedded tiny.en's CTranslate2 directory, brought as a model of its own name."""
    model = tmp_path_factory.mktemp("models") / NAME
    model.symlink_to(embedded_model_dir(), target_is_directory=True)
    srv = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, llm=False, default_responder="echo", grace_s=1,
                                     asr_model=str(model), asr_backend="torch"))
    await srv.start()
    yield srv
    await srv.stop(0)


async def test_the_apis_name_the_model_brought(server, channel, web_front) -> None:
    described = await speech_pb2_grpc.SpeechServiceStub(channel).DescribeRecognizer(
        speech_pb2.DescribeRecognizerRequest())
    assert (described.name, described.runtime, described.compute_type, list(described.languages)) == \
        (NAME, "torch", "float32", ["en"])
    riva = await riva_asr_pb2_grpc.RivaSpeechRecognitionStub(channel).GetRivaSpeechRecognitionConfig(
        riva_asr_pb2.RivaSpeechRecognitionConfigRequest())
    assert [c.model_name for c in riva.model_config] == [f"{NAME}-en-US-asr-streaming"]
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{web_front.port}/v1/models") as answer:
        assert NAME in [m["id"] for m in (await answer.json())["data"]]


async def test_it_hears_through_the_torch_runtime(server, channel) -> None:
    speaker = Speaker()
    pcm = np.concatenate([speaker.silence(0.5), speaker.say(SENTENCE), speaker.silence(1.0)]).tobytes()
    config = speech_pb2.TranscribeConfig(audio_format=common_pb2.AudioFormat(sample_rate=16000), language="en-US")

    async def requests():
        yield speech_pb2.TranscribeRequest(config=config)
        yield speech_pb2.TranscribeRequest(audio=pcm)

    finals = [r async for r in speech_pb2_grpc.SpeechServiceStub(channel).Transcribe(requests()) if r.is_final]
    assert len(finals) == 1 and wer(SENTENCE, finals[0].text) == 0 and finals[0].language == "en", finals
    sample = server.metrics.registry.get_sample_value
    assert sample("rtmedia_graph_misses_total", {"engine": "asr", "reason": "ineligible"}) >= 1  # a CPU's
    assert sample("rtmedia_graphs", {"engine": "asr"}) == 0


async def test_a_realtime_transcription_session_names_the_model_brought(openai_client) -> None:
    """The Realtime API takes the recogniser's own name as a transcription model, and names it
    among the models when refusing another."""
    async with openai_client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await _next(conn, "session.created")
        for model, answer in ((NAME, "session.updated"), ("no-such-asr", "error")):
            await conn.session.update(session={"type": "transcription", "audio": {"input": {
                "transcription": {"model": model, "language": "en"}}}})
            event = await _next(conn, answer)
        assert event.error.code == "model_not_found" and NAME in event.error.message


async def _next(conn, kind: str):
    async def run():
        while (event := await conn.recv()).type != kind:
            pass
        return event

    return await asyncio.wait_for(run(), 30)
