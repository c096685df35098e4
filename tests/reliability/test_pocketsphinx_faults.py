"""PocketSphinx's worker processes under faults (`--asr pocketsphinx`), on the in-process
server: a worker SIGKILLed (what the kernel's OOM killer does) ends its stream with
UNAVAILABLE, is restarted, and the next Transcribe succeeds on it; a worker that cannot be
restarted takes the speech services out of health until it can."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from rtmedia.engines.asr.pocketsphinx import AsrEngine
from rtmedia.protocol.errors import error_reason
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

from tests.reliability.test_faults import (
    NOT_SERVING,
    REALTIME,
    RIVA_ASR,
    SENTENCE,
    SERVING,
    SPEECH,
    VIDEO,
    all_serving,
    gauge,
    health_becomes,
)
from tests.support.speech import transcribe
from tests.support.waits import metric_at_least, until

# Two PocketSphinx workers, and lanes that turn unhealthy quickly.
SERVER_OPTIONS = {"asr": "pocketsphinx", "asr_workers": 2, "asr_decoders": 2, "lane_unhealthy_after_s": 0.5}


async def test_a_killed_asr_worker_is_restarted_and_the_next_transcribe_succeeds(server, channel, speaker):
    engine: AsrEngine = server.scheduler.lanes["asr"].engine
    rate = 16000
    pcm = speaker.say(SENTENCE, rate).tobytes()
    stub = speech_pb2_grpc.SpeechServiceStub(channel)
    opened, go, done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def requests():
        yield speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(sample_rate=rate)))
        yield speech_pb2.TranscribeRequest(audio=pcm[:rate])
        opened.set()
        await go.wait()
        yield speech_pb2.TranscribeRequest(audio=pcm[rate:2 * rate])
        await done.wait()  # no more: the server ends the call

    restarts = list(engine.restarts)
    # The last test's session may still be closing its stream: the one to find must be this call's.
    await until(lambda: engine.open_streams == 0, what="earlier streams closing")
    call = stub.Transcribe(requests())

    async def read_all() -> None:
        while await call.read() != grpc.aio.EOF:
            pass

    reading = asyncio.ensure_future(read_all())
    await asyncio.wait_for(opened.wait(), 10)
    await until(lambda: engine.open_streams == 1, what="the stream opening")
    [stream] = engine._open.values()
    victim = engine._procs[stream.worker]
    os.kill(victim.pid, signal.SIGKILL)  # what the kernel's OOM killer does
    await until(lambda: not victim.is_alive(), what="the worker's death")
    go.set()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(reading, 30)
    done.set()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and error_reason(err.value) == "ENGINE_UNAVAILABLE"
    assert f"ASR worker {stream.worker}" in err.value.details() and "Traceback" not in err.value.details()
    assert SENTENCE.split()[1] in await transcribe(channel, pcm, rate), "the next Transcribe succeeds"
    await until(lambda: engine.restarts[stream.worker] == restarts[stream.worker] + 1, timeout=60,
                what="the worker's restart")
    # The counter is set a moment after the engine counts the restart: await it, not read it once.
    await metric_at_least(server, "rtmedia_asr_worker_restarts_total", 1, worker=str(stream.worker))
    # Both workers serve again: two Transcribes at once take one each.
    texts = await asyncio.gather(transcribe(channel, pcm, rate), transcribe(channel, pcm, rate))
    assert all("quick brown fox" in text for text in texts), texts
    await until(lambda: engine.open_streams == 0, what="the streams closing")
    assert gauge(server, "rtmedia_asr_streams", worker=str(stream.worker)) == 0
    assert gauge(server, "rtmedia_asr_decoders", worker=str(stream.worker)) == 3, "1 default + 2 fast, as warmed"
    assert await server.scheduler.check_health() == {}


async def test_a_worker_that_cannot_be_restarted_takes_the_speech_services_out_of_health(server, channel,
                                                                                       monkeypatch):
    engine: AsrEngine = server.scheduler.lanes["asr"].engine
    real_spawn = engine._spawn

    def cannot(i):
        raise OSError("injected: cannot start a process")

    monkeypatch.setattr(engine, "_spawn", cannot)
    monkeypatch.setattr("rtmedia.engines.asr.pocketsphinx._RESTART_PAUSE_S", 0.05)
    monkeypatch.setattr(engine, "restart_backoff_s", 0.5)
    victim = engine._procs[0]
    os.kill(victim.pid, signal.SIGKILL)
    await until(lambda: not victim.is_alive(), what="the worker's death")
    engine._call_each({0: ("ping", None)})  # a call finds it dead (as the next step on it would)
    await health_becomes(channel, {"": NOT_SERVING, SPEECH: NOT_SERVING, REALTIME: NOT_SERVING, VIDEO: SERVING,
                                   RIVA_ASR: NOT_SERVING})
    assert "ASR worker 0 could not be restarted" in server.scheduler.unhealthy["asr"]
    monkeypatch.setattr(engine, "_spawn", real_spawn)
    await health_becomes(channel, all_serving(), timeout=60)
    assert engine.fault() is None and engine._procs[0].is_alive()
