"""POST /v1/audio/speech through the official `openai` SDK: every response format decoded with
PyAV and transcribed back by the server, the extension `sample_rate`, `speed`, streaming (the
first bytes leave before the last sentence is synthesised), SSE, and every refusal in
OpenAI's shape."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import aiohttp
import av
import numpy as np
import openai
import pytest
from rtmedia.engines.base import EngineError
from rtmedia.v1 import speech_pb2, speech_pb2_grpc

from tests.support.speech import normalise, transcribe, wer
from tests.support.waits import until

SENTENCE = "Please remember to buy milk, bread and eggs on your way home."
KEY_WORDS = ("milk", "bread", "eggs", "home")
FIRST = "Good morning."
STORY = (FIRST + " The weather today is sunny with a light breeze from the west. "
         "Our meeting starts at nine o'clock in the large conference room. "
         "Please remember to buy milk, bread and eggs on your way home. "
         "The train to the city leaves from the second platform every hour.")
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/opus", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}
ASR_RATE = 16000


def decode(data: bytes, fmt: str, rate: int = 24000) -> tuple[int, np.ndarray, float]:
    """(the rate the file states, its audio as PCM16 mono at ASR_RATE, its duration in s),
    decoded and resampled by PyAV; `rate` is only for raw pcm, which states none."""
    resampler = av.AudioResampler(format="s16", layout="mono", rate=ASR_RATE)
    if fmt == "pcm":
        samples = np.frombuffer(data, "<i2")
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        frames, stated, duration = [frame], rate, len(samples) / rate
    else:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            frames = list(container.decode(stream))
            stated = stream.codec_context.sample_rate
            if fmt == "opus":  # Opus decodes at 48 kHz; OpusHead holds the rate it was encoded from
                stated = int.from_bytes(stream.codec_context.extradata[12:16], "little")
        duration = sum(f.samples for f in frames) / frames[0].sample_rate
    out = [r for f in [*frames, None] for r in resampler.resample(f)]
    return stated, np.concatenate([r.to_ndarray().reshape(-1) for r in out]), duration


async def heard(channel, pcm16k: np.ndarray) -> str:
    return await transcribe(channel, pcm16k.astype("<i2").tobytes(), ASR_RATE)


def assert_heard(text: str, reference: str = SENTENCE, words: tuple[str, ...] = KEY_WORDS) -> None:
    assert wer(reference, text) <= 0.5, (reference, text)
    found = set(normalise(text).split())
    assert sum(w in found for w in words) >= len(words) - 1, (words, text)


async def speech(client, **kw) -> bytes:
    kw = {"model": "tts-1", "voice": "alloy", "input": SENTENCE, **kw}
    return (await client.audio.speech.create(**kw)).content


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
async def test_every_format_decodes_at_24k_and_says_the_input(openai_client, channel, fmt):
    raw = await openai_client.audio.speech.with_raw_response.create(
        model="gpt-4o-mini-tts", voice="coral", input=SENTENCE, response_format=fmt, instructions="Speak calmly.")
    assert raw.headers["content-type"] == CONTENT_TYPES[fmt]
    rate, pcm, duration = decode(raw.content, fmt)
    assert rate == 24000
    assert 2.0 <= duration <= 7.0, duration
    assert_heard(await heard(channel, pcm))


async def test_default_format_is_mp3(openai_client):
    data = await speech(openai_client, input="Hello there.")
    with av.open(io.BytesIO(data)) as container:
        assert container.format.name == "mp3"
        assert container.streams.audio[0].codec_context.sample_rate == 24000


async def test_sample_rate_8000_gives_8k_audio(openai_client):
    """Telephone-band audio: its rate and length (PocketSphinx's wideband model hears it badly)."""
    rate, _, duration = decode(await speech(openai_client, response_format="wav", extra_body={"sample_rate": 8000}),
                               "wav")
    _, _, wideband = decode(await speech(openai_client, response_format="wav"), "wav")
    assert rate == 8000
    assert abs(duration - wideband) < 0.15 * wideband, (duration, wideband)


async def test_faster_speed_gives_shorter_audio(openai_client):
    normal = len(await speech(openai_client, response_format="pcm"))
    fast = len(await speech(openai_client, response_format="pcm", speed=1.5))
    assert fast < 0.8 * normal, (fast, normal)


async def test_opus_at_48k_and_a_refused_opus_rate(openai_client, channel):
    rate, pcm, _ = decode(await speech(openai_client, response_format="opus", extra_body={"sample_rate": 48000}),
                          "opus")
    assert rate == 48000
    assert_heard(await heard(channel, pcm))
    with pytest.raises(openai.BadRequestError) as caught:
        await speech(openai_client, response_format="opus", extra_body={"sample_rate": 16000})
    assert caught.value.param == "sample_rate"
    assert "24000" in caught.value.message and "48000" in caught.value.message


async def test_rtmedia_voice_names_and_a_voice_object(openai_client, channel):
    voices = await speech_pb2_grpc.SpeechServiceStub(channel).ListVoices(speech_pb2.ListVoicesRequest())
    by_name = await speech(openai_client, response_format="wav", voice=voices.voices[0].name, model="rtmedia-piper")
    by_object = await speech(openai_client, response_format="wav", voice={"id": "nova"})
    # OpenAI's names speak with the default voice, the only one here (Piper's noise varies the samples).
    assert abs(decode(by_name, "wav")[2] - decode(by_object, "wav")[2]) < 0.5


def prefix_duration(data: bytes, fmt: str) -> float:
    """Seconds of audio in the first bytes of a file, as a player receiving them would have."""
    if fmt == "pcm":
        return len(data) / 2 / 24000
    total = 0.0
    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(container.streams.audio[0]):
                total += frame.samples / frame.sample_rate
    except av.FFmpegError:  # a cut last frame, or too few bytes for a header yet
        pass
    return total


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus"])
async def test_first_clause_leaves_before_the_last_is_synthesised(openai_client, fmt):
    """The first audio the client gets is the first (short) sentence, nearly whole (a codec holds
    back less than a frame) and nothing of the next, and it comes well before the stream ends:
    the encoder and the container flush at every clause."""
    first_clause = decode(await speech(openai_client, response_format="pcm", input=FIRST), "pcm")[2]
    arrivals: list[tuple[float, int]] = []
    data = b""
    started = time.perf_counter()
    async with openai_client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="alloy", input=STORY, response_format=fmt) as response:
        async for piece in response.iter_bytes():
            data += piece
            arrivals.append((time.perf_counter() - started, len(data)))
    # What the client holds once the first audio has come (a read may split one write):
    durations = [(t, prefix_duration(data[:n], fmt)) for t, n in arrivals]
    first_audio = next(t for t, d in durations if d > 0)
    burst = max(d for t, d in durations if t <= first_audio + 0.05)
    assert 0.6 * first_clause <= burst <= first_clause + 0.3, (burst, first_clause, durations)
    assert first_audio < 0.5 * arrivals[-1][0], durations
    assert decode(data, fmt)[2] >= 8.0


@pytest.mark.parametrize("fmt", ["mp3", "wav"])
async def test_sse_deltas_decode_and_done_has_usage(web_front, channel, fmt):
    body = {"model": "gpt-4o-mini-tts", "voice": "alloy", "input": SENTENCE, "response_format": fmt,
            "stream_format": "sse"}
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{web_front.port}/v1/audio/speech", json=body,
            headers={"Authorization": "Bearer rtmedia-test"}) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        events = []
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] == len(SENTENCE.split()) and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    rate, pcm, duration = decode(b"".join(base64.b64decode(e["audio"]) for e in deltas), fmt)
    assert rate == 24000 and 2.0 <= duration <= 7.0
    if fmt == "mp3":  # the bytes are those of the audio answer, whose every format is heard above
        assert_heard(await heard(channel, pcm))


async def test_a_failure_mid_stream_truncates_the_body(openai_client, server, monkeypatch):
    tts = server.access.tts
    real = tts.synthesize
    calls = 0

    async def failing(item, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > 1:
            raise EngineError("synthesis broke (test)")
        return await real(item, *args, **kwargs)

    monkeypatch.setattr(tts, "synthesize", failing)
    received = 0
    with pytest.raises(Exception) as caught:  # the SDK's HTTP library's own transport error
        async with openai_client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=STORY, response_format="pcm") as response:
            assert response.status_code == 200
            async for piece in response.iter_bytes():
                received += len(piece)
    assert "incomplete" in str(caught.value).lower() or "closed" in str(caught.value).lower(), caught.value
    assert received > 0


async def test_a_client_that_leaves_mid_stream_frees_its_slot(web_front):
    """The synthesis is cancelled and the request's slot freed when the client goes away."""
    body = {"model": "tts-1", "voice": "alloy", "input": STORY * 3, "response_format": "mp3"}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"http://127.0.0.1:{web_front.port}/v1/audio/speech", json=body)
        assert response.status == 200 and await response.content.read(100)
        assert web_front.openai.active == 1
        response.close()  # drops the connection
    await until(lambda: web_front.openai.active == 0, timeout=5, what="the dropped synthesis ending")
    assert web_front.openai.active == 0


ERRORS = [
    ({"input": None}, openai.BadRequestError, 400, "input"),
    ({"input": ""}, openai.BadRequestError, 400, "input"),
    ({"input": "   "}, openai.BadRequestError, 400, "input"),
    ({"input": "?!"}, openai.BadRequestError, 400, "input"),
    ({"input": "a" * 5001}, openai.BadRequestError, 400, "input"),
    ({"input": 42}, openai.BadRequestError, 400, "input"),
    ({"voice": "nobody"}, openai.BadRequestError, 400, "voice"),
    ({"voice": None}, openai.BadRequestError, 400, "voice"),
    ({"response_format": "ogg"}, openai.BadRequestError, 400, "response_format"),
    ({"speed": 0.1}, openai.BadRequestError, 400, "speed"),
    ({"speed": 5}, openai.BadRequestError, 400, "speed"),
    ({"speed": "fast"}, openai.BadRequestError, 400, "speed"),
    ({"stream_format": "chunks"}, openai.BadRequestError, 400, "stream_format"),
    ({"stream_format": "sse"}, openai.BadRequestError, 400, "stream_format"),  # tts-1 has no SSE at OpenAI
    ({"instructions": ["loud"]}, openai.BadRequestError, 400, "instructions"),
    ({"extra_body": {"sample_rate": 12345}}, openai.BadRequestError, 400, "sample_rate"),
    ({"extra_body": {"sample_rate": "high"}}, openai.BadRequestError, 400, "sample_rate"),
    ({"model": "tts-9"}, openai.NotFoundError, 404, "model"),
]


@pytest.mark.parametrize(("kw", "kind", "status", "param"), ERRORS, ids=[str(e[0])[:40] for e in ERRORS])
async def test_refusals_in_openais_shape(openai_client, kw, kind, status, param):
    with pytest.raises(kind) as caught:
        await speech(openai_client, **kw)
    error = caught.value
    assert error.status_code == status
    assert error.param == param, error.body
    assert error.type == "invalid_request_error" and error.code and error.message
    if kw.get("voice") == "nobody":  # the server's voices, and OpenAI's names as well
        assert "alloy" in error.message and "en_US-joe-medium" in error.message


@pytest.mark.parametrize(("data", "content_type", "code"), [
    (b'{"model": "tts-1", "input": ', "application/json", "invalid_json"),
    (b'["tts-1"]', "application/json", "invalid_type"),
    (b'{"model": "tts-1", "input": "Hi.", "voice": "alloy"}', "text/plain", "unsupported_content_type"),
])
async def test_raw_bodies_refused_in_openais_shape(web_front, data, content_type, code):
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{web_front.port}/v1/audio/speech", data=data,
            headers={"Content-Type": content_type}) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["message"]


async def test_the_front_serves_requests_at_once(openai_client):
    """Two requests at once, in two formats, both complete whole."""
    a, b = await asyncio.gather(speech(openai_client, response_format="flac", input="Good morning."),
                                speech(openai_client, response_format="aac", input="Good evening."))
    assert decode(a, "flac")[0] == decode(b, "aac")[0] == 24000
